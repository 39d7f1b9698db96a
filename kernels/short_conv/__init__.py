from kernels.short_conv.naive import naive_short_conv

__all__ = ["naive_short_conv"]
