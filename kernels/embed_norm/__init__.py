"""The embedding's row gather and the first layer's input RMSNorm in one launch. ``embed_rms_norm`` (Triton) loads
lazily."""

from kernels.embed_norm.naive import naive_embed_rms_norm

_TRITON = ("embed_rms_norm",)


def __getattr__(name: str):
    if name in _TRITON:
        from kernels.embed_norm import triton as _impl

        return getattr(_impl, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["embed_rms_norm", "naive_embed_rms_norm"]
