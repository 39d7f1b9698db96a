"""The sections of bench/gpu_kernels_check.py (fast kernels vs naive references at real shapes), one module per
kernel family, and their shared reporting helpers (report.py)."""
