"""One dequantised SmolLM2 per test session (CI pays the ~20 s GGUF load once).

Importing this module points ``SPARSEFLOW_CACHE_DIR`` at a fresh temporary folder unless it is
already set (CI or a developer may keep one across runs), so every ``load_smollm2()`` of the
session (this project's tests and any other test module) loads the cached fp32 folder after
the first call has written it. The folder is removed when the session ends.
"""

import atexit
import os
import shutil
import tempfile

from sparseflow.checkpoints import CACHE_ENV


def session_cache_dir() -> str:
    folder = os.environ.get(CACHE_ENV)
    if not folder:
        folder = tempfile.mkdtemp(prefix="sparseflow-test-cache-")
        os.environ[CACHE_ENV] = folder
        atexit.register(shutil.rmtree, folder, True)
    return folder


CACHE_DIR = session_cache_dir()
