"""Page gather / scatter (P/D handoff, prefix tier). ``pack_pages`` / ``unpack_pages`` (Triton) load lazily."""

from kernels.page_copy.naive import naive_pack_pages, naive_unpack_pages, token_rows

_TRITON = ("pack_pages", "unpack_pages")


def __getattr__(name: str):
    if name in _TRITON:
        from kernels.page_copy import triton as _impl

        return getattr(_impl, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["naive_pack_pages", "naive_unpack_pages", "pack_pages", "token_rows", "unpack_pages"]
