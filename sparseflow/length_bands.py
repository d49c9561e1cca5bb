"""Settings by prompt length: ``((tokens, settings), ...)``, tokens increasing, as a recipe
(``Recipe.longer``), a converted model's plan (``Plan.longer``) and the rewrite's options carry
them. A call with at least ``tokens`` keys runs that band's settings."""

from __future__ import annotations

from typing import Any, Sequence, Tuple

__all__ = ["band_for", "check_bands"]


def band_for(longer: Sequence[Tuple[int, Any]], n_keys, shortest) -> Tuple[int, Any]:
    """``(tokens, settings)``: the last band of ``longer`` that ``n_keys`` keys reach, else
    ``(0, shortest)``. A symbolic ``n_keys`` (a Dynamo graph's length) gets a guard from each
    comparison, so a length in another band compiles anew."""
    chosen = (0, shortest)
    for band in longer:
        if n_keys >= band[0]:
            chosen = band
    return chosen


def check_bands(longer, kind: type, where: str, error: type = ValueError) -> None:
    """Raise ``error`` unless ``longer`` holds ``(tokens, settings)`` pairs with increasing
    positive token counts and ``settings`` of type ``kind`` without bands of their own (``where``
    names the field in the message)."""
    previous = 0
    for band in longer:
        if not (isinstance(band, tuple) and len(band) == 2):
            raise error(f"{where} must hold (tokens, {kind.__name__}) pairs, got {band!r}")
        tokens, settings = band
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= previous:
            raise error(f"{where}'s token counts must be increasing integers > {previous}, got {tokens!r}")
        previous = tokens
        if not isinstance(settings, kind):
            raise error(f"{where}[{tokens}] must be a {kind.__name__}, got {settings!r}")
        if settings.longer:
            raise error(f"{where}[{tokens}] has bands of its own; give them all here")
