from kernels.short_conv.naive import naive_short_conv
from kernels.short_conv.naive_spec import naive_short_conv_update

__all__ = ["naive_short_conv", "naive_short_conv_update", "short_conv_update"]


def __getattr__(name: str):
    # the Triton kernel loads lazily: importing this package must not import triton (a GPU/test extra)
    if name == "short_conv_update":
        from kernels.short_conv.triton import short_conv_update

        return short_conv_update
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
