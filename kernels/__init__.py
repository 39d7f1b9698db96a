"""Compute kernels. Each op lives in ``kernels/<op>/`` with a plain PyTorch reference (``naive.py``)
that defines the op's contract; fast versions (Triton, fla-core) sit beside it and are tested against it."""
