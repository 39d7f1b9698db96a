"""KDA state slot copies (prefix-cache forks). ``copy_state_slots`` (Triton) is imported lazily."""

from kernels.state_copy.naive import check_pairs, naive_copy_state_slots


def __getattr__(name: str):
    if name == "copy_state_slots":
        from kernels.state_copy.triton import copy_state_slots

        return copy_state_slots
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["check_pairs", "copy_state_slots", "naive_copy_state_slots"]
