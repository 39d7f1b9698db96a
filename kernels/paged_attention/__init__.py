from kernels.paged_attention.naive import (
    causal_attention,
    gather_pages,
    paged_gqa_attention,
    paged_mla_attention,
    scatter_pages,
)

_TRITON = {  # name -> module of this package
    "attention_fwd": "triton",
    "build_attn_meta": "meta",
    "pack_block_tables": "meta",
    "paged_gqa_attention_triton": "triton",
    "paged_mla_attention_triton": "mla",
    "plan_gqa": "meta",
    "plan_mla": "mla",
    "run_mla": "mla",
}

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
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_TRITON[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
