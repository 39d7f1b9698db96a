"""Weight prefetch into the GPU's L2 cache ahead of a bandwidth-bound launch (kernels/prefetch/triton.py)."""
