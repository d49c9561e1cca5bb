"""Kernels shared by the methods: token-sparse attention, block summaries, flex helpers, launch sizes.
Each method's own code lives in its folder, sparseflow/methods/<method>/."""
