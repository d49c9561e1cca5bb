"""Whether Triton kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``).

Triton reads the switch itself when a kernel is decorated; the kernels' host code and the
dispatcher ask this function instead of parsing the variable each on its own. It is read per
call, so a test that sets the variable after import sees its value in the dispatcher.
"""

from __future__ import annotations

import os

__all__ = ["interpreting"]


def interpreting() -> bool:
    """True when ``TRITON_INTERPRET`` is ``"1"`` (the kernels then run in the CPU interpreter)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
