from kernels.moe.naive import naive_moe, sigmoid_topk_route

__all__ = ["naive_moe", "sigmoid_topk_route"]
