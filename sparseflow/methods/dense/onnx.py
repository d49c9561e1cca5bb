"""ONNX function body of ``DenseAttention``: the text spliced between the shared prologue and
epilogue of :mod:`sparseflow.onnx_export`."""

# Dense: SDPA semantics (top-left causal alignment, as SDPA) & key padding.
MASK = """
  tri = LessOrEqual (jk_row, iq_col)
  vis = Or (tri, not_causal)
  allowed = And (vis, kpm4)
  allowed5 = Unsqueeze (allowed, i2)
  cfg_ok = Cast <to = 9> (one)
"""
