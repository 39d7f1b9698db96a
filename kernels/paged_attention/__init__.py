from kernels.paged_attention.naive import (
    causal_attention,
    gather_pages,
    paged_gqa_attention,
    paged_mla_attention,
    scatter_pages,
)

_TRITON = (
    "attention_fwd",
    "build_attn_meta",
    "pack_block_tables",
    "paged_gqa_attention_triton",
    "paged_mla_attention_triton",
    "plan_gqa",
    "plan_mla",
    "run_mla",
)

__all__ = [
    "causal_attention",
    "gather_pages",
    "paged_gqa_attention",
    "paged_mla_attention",
    "scatter_pages",
    *_TRITON,
]


def __getattr__(name: str):
    # the Triton kernels load lazily: importing this package must not import triton (a GPU/test extra)
    if name in _TRITON:
        from kernels.paged_attention import triton as _impl

        return getattr(_impl, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
