"""Research and evaluation tools: fidelity against dense, attention mass, needle retrieval,
parameter sweeps, selection diagnostics, plots (what ``sparseflow eval`` / ``calibrate`` and the
studies use).

Nothing on the rewrite or attention path imports this package.
"""
