"""Skinny GEMM (GEMV) for decode-sized steps: y = x @ W^T with few rows of x. ``gemv`` (Triton) loads lazily."""

from kernels.gemv.naive import naive_gemv

_TRITON = ("gemv", "gemv_tile", "GemvTile", "GEMV_MAX_ROWS")


def __getattr__(name: str):
    if name in _TRITON:
        from kernels.gemv import triton as _impl

        return getattr(_impl, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["GEMV_MAX_ROWS", "GemvTile", "gemv", "gemv_tile", "naive_gemv"]
