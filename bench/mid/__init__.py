"""Issue-5/6 GPU benchmarks on mid-size checkpoints (real per-layer shapes, few layers, random weights)."""
