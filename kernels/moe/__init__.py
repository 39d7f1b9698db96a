from kernels.moe.grouped import grouped_moe, moe_align
from kernels.moe.naive import naive_moe, sigmoid_topk_route

__all__ = ["grouped_moe", "moe_align", "naive_moe", "sigmoid_topk_route", "sigmoid_topk_route_triton"]


def __getattr__(name: str):
    # the Triton kernel loads lazily: importing this package must not import triton (a GPU/test extra)
    if name == "sigmoid_topk_route_triton":
        from kernels.moe.triton import sigmoid_topk_route_triton

        return sigmoid_topk_route_triton
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
