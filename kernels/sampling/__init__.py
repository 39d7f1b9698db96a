"""Greedy sampling on the device: the argmax of every logits row. ``argmax_rows`` (Triton) loads lazily."""

from kernels.sampling.naive import naive_argmax_rows

_TRITON = ("argmax_rows",)


def __getattr__(name: str):
    if name in _TRITON:
        from kernels.sampling import triton as _impl

        return getattr(_impl, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["argmax_rows", "naive_argmax_rows"]
