"""A GGUF file's header parsed once per load, not once per reader.

transformers parses the whole GGUF header for the config, again for the tokenizer and again for
the weights, and the header check before them parses it too. For a large vocabulary that is the
load's main cost: Gemma 3's 262K tokens take about 18 s a parse on a 2-core CPU. Inside
:func:`gguf_parsed_once`, every ``gguf.GGUFReader(path)`` of an unchanged file returns the reader
made first; the readers are dropped when the block ends.
"""

from __future__ import annotations

import contextlib
import os
from typing import Dict, Iterator, Tuple

__all__ = ["gguf_parsed_once"]


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """Share one reader per GGUF file (path, size and modification time) inside the block; a
    nested block uses the outer block's readers. A no-op without the ``gguf`` package."""
    try:
        import gguf
    except ImportError:
        yield
        return
    real = gguf.GGUFReader
    if getattr(real, "shares_readers", False):
        yield
        return
    readers: Dict[Tuple, object] = {}

    def shared_reader(path, mode="r"):
        st = os.stat(path)
        key = (os.path.realpath(path), mode, st.st_size, st.st_mtime_ns)
        if key not in readers:
            readers[key] = real(path, mode)
        return readers[key]

    shared_reader.shares_readers = True
    gguf.GGUFReader = shared_reader  # transformers imports it from the module at each load
    try:
        yield
    finally:
        gguf.GGUFReader = real
