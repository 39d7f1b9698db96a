"""The greedy ids of a decode step's logits on the device (what the overlapped decoder carries into the next
step and copies home): torch's argmax as the reference, the two-launch Triton kernel on CUDA
(kernels/sampling/triton.py: the one-row reduction of torch's argmax is 3-4x slower at decode batches)."""

from __future__ import annotations

import torch

from kernels.env import env_switch
from kernels.sampling.naive import naive_argmax_rows


class TorchGreedy:
    def argmax_rows(self, logits: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """[S, V] logits -> ids into out [S] int64: the first of equal maxima (the sampler's greedy rule)."""
        return naive_argmax_rows(logits, out)


class TritonGreedy(TorchGreedy):
    """kernels/sampling/triton.py on CUDA tensors (and on the host under TRITON_INTERPRET=1). With
    ``TANDEM_ARGMAX_ONE_LAUNCH=1`` the chunks' maxima and the rows' reduction run in one launch (its last program
    takes the rows after a ticket), up to ``ONE_LAUNCH_MAX_ROWS`` rows; off by default until a step has timed it."""

    def __init__(self) -> None:
        from kernels.triton_utils import LaunchTicket

        self.one_launch = env_switch("TANDEM_ARGMAX_ONE_LAUNCH", False)
        self._ticket = LaunchTicket()  # made outside any capture, reused by every launch on a device

    def argmax_rows(self, logits: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        from kernels.sampling.triton import argmax_rows
        from kernels.triton_utils import is_interpreting

        if not logits.is_cuda and not is_interpreting():
            return super().argmax_rows(logits, out)
        return argmax_rows(logits, out, self._ticket.get(logits.device) if self.one_launch else None)
