"""Settings by prompt length: ``((tokens, settings), ...)``, tokens increasing, as a recipe
(``Recipe.longer``), a converted model's plan (``Plan.longer``) and the rewrite's options carry
them. A call with at least ``tokens`` keys runs that band's settings."""

from __future__ import annotations

from typing import Any, Sequence, Tuple

__all__ = ["band_for"]


def band_for(longer: Sequence[Tuple[int, Any]], n_keys, shortest) -> Tuple[int, Any]:
    """``(tokens, settings)``: the last band of ``longer`` that ``n_keys`` keys reach, else
    ``(0, shortest)``. A symbolic ``n_keys`` (a Dynamo graph's length) gets a guard from each
    comparison, so a length in another band compiles anew."""
    chosen = (0, shortest)
    for band in longer:
        if n_keys >= band[0]:
            chosen = band
    return chosen
