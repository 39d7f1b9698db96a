"""Skinny GEMM (GEMV) for decode-sized steps: y = x @ W^T with few rows of x. ``gemv`` (Triton) loads lazily."""

from kernels.gemv.naive import (
    add_rms_norm_reference,
    naive_add_norm_gemv,
    naive_gated_norm_gemv,
    naive_gemv,
    naive_gemv_norm_after,
    naive_head_gemv,
)

_TRITON = ("gemv", "gemv_norm_after", "gemv_tile", "GemvTile", "GEMV_MAX_ROWS")
_GATED = ("gated_norm_gemv", "gated_norm_gemv_fits", "gated_norm_gemv_norm_after")
_ADD_NORM = ("add_norm_gemv", "add_norm_gemv_fits")
_HEADS = ("head_gemv",)


def __getattr__(name: str):
    if name in _TRITON:
        from kernels.gemv import triton as _impl

        return getattr(_impl, name)
    if name in _GATED:
        from kernels.gemv import gated_norm as _gated

        return getattr(_gated, name)
    if name in _ADD_NORM:
        from kernels.gemv import add_norm as _add_norm

        return getattr(_add_norm, name)
    if name in _HEADS:
        from kernels.gemv import heads as _heads

        return getattr(_heads, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "GEMV_MAX_ROWS",
    "GemvTile",
    "add_norm_gemv",
    "add_norm_gemv_fits",
    "add_rms_norm_reference",
    "gated_norm_gemv",
    "gated_norm_gemv_fits",
    "gated_norm_gemv_norm_after",
    "gemv",
    "gemv_norm_after",
    "gemv_tile",
    "head_gemv",
    "naive_add_norm_gemv",
    "naive_gated_norm_gemv",
    "naive_gemv",
    "naive_gemv_norm_after",
    "naive_head_gemv",
]
