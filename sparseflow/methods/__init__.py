"""The attention methods, one package each, behind the registry of :mod:`.registry`.

Importing this package registers the built-in methods (dense, PBS, PISA, BSA); a further method
is one package calling :func:`register` with its :class:`MethodSpec`.
"""

from . import dense, pbs, pisa, bsa  # noqa: F401  (each registers its spec)
from .registry import (
    Backend,
    Decode,
    MethodSpec,
    OnnxBody,
    names,
    names_with,
    or_list,
    register,
    sparse_names,
    spec_for,
    specs,
    unregister,
    windowed,
)

__all__ = [
    "Backend",
    "Decode",
    "MethodSpec",
    "OnnxBody",
    "names",
    "names_with",
    "or_list",
    "register",
    "sparse_names",
    "spec_for",
    "specs",
    "unregister",
    "windowed",
]
