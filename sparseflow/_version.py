"""The one version string. ``sparseflow.__version__`` re-exports it and pyproject.toml reads it
from here ([tool.setuptools.dynamic]); modules inside the package import it from here, not from
``sparseflow``, whose ``__init__`` imports them."""

__version__ = "0.1.0"
