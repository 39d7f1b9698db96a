from kernels.paged_attention.naive import (
    causal_attention,
    gather_pages,
    paged_gqa_attention,
    paged_mla_attention,
    scatter_pages,
)

__all__ = [
    "causal_attention",
    "gather_pages",
    "paged_gqa_attention",
    "paged_mla_attention",
    "scatter_pages",
]
