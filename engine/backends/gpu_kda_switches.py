"""The GPU KDA backend's switches and thresholds (engine/backends/gpu_kda.py), each with the measurement behind it.

The ``TANDEM_KDA_*`` environment switches are read once at import: they exist for A / B runs of one process each.
"""

from __future__ import annotations

import os

from kernels.env import env_switch
from kernels.short_conv.low_rank import LOW_RANK_BLOCK_CS

FLA_CONV_MIN_LEN = (
    256  # steps with a chunk this long run the short conv through fla (kernels/short_conv/fla_adapter.py)
)
PLANES_MIN_LEN = FLA_CONV_MIN_LEN
"""Prefill steps with a chunk this long take the q|k|v conv with q / k normed in one launch
(kernels/short_conv/planes.py) instead of fla's conv and two ``l2norm`` passes: on the H200, 8-row sub-tiles at
2 warps, 248 vs 284 us a layer at 8k tokens, 959 vs 1,056 us at 32k (docs/PERFORMANCE.md, sixteenth session).
``TANDEM_KDA_CONV_PLANES=0`` keeps fla's conv + norms (A/B runs)."""
CONV_PLANES = env_switch("TANDEM_KDA_CONV_PLANES", True)
GATE_IN_CHUNK = env_switch("TANDEM_KDA_GATE_IN_CHUNK", True)
"""Prefill-only steps hand chunk_kda the raw gate projection and let fla apply the gate inside its chunk cumsum
(one pass over [T, H, K] fp32 instead of fla's gate kernel, then the cumsum: 0.38 + 0.41 ms at 8k tokens, 6
layers). On the H200 an 8k prefill took 39.4 vs 40.6 ms through the piecewise graphs (docs/PERFORMANCE.md,
seventeenth session); the GPU tests check its tokens and states there (fla's fused path cannot run under the
interpreter: the host tests check the wiring with the reference chunk function). ``TANDEM_KDA_GATE_IN_CHUNK=0``
gates first (A/B runs)."""


DECODE_GATE_IN_KERNEL = env_switch("TANDEM_KDA_DECODE_GATE_IN_KERNEL", True)
"""All-decode steps hand fla's recurrent kernel the raw gate projection and beta's logits
(``USE_GATE_IN_KERNEL``, ``APPLY_BETA_SIGMOID``): the gate kernel, the sigmoid (a view of one row at batch 1: no
copy left) and the output's zero fill leave the decode step, 2-3 launches a KDA layer. The gate is fla's gate
kernel's formula (the same fp32 ops); beta stays fp32 instead of being rounded to bf16 first.
``TANDEM_KDA_DECODE_GATE_IN_KERNEL=0`` gates and takes the sigmoid first (A/B runs)."""


LOW_RANK_IN_CONV = env_switch("TANDEM_KDA_LOW_RANK_IN_CONV", True)
"""All-decode steps of at most ``LOW_RANK_MAX_ROWS`` rows run the f_b | g_b up-projections in the short conv's launch
(kernels/short_conv/low_rank.py) instead of their own batched GEMM: one launch a KDA layer fewer.
``TANDEM_KDA_LOW_RANK_IN_CONV=0`` keeps the GEMM (A/B runs)."""
LOW_RANK_MAX_ROWS = 1
"""Rows up to which the conv's extra programs take the up-projections. On the H100 (docs/PERFORMANCE.md,
thirty-second session) b1 steps gained 18 us, b16 lost 7-15 us and b64 66-75 us (each of those programs walks every
row of its channels, after the conv's programs); 2-8 rows were not timed."""


def low_rank_block_c_from_env() -> int:
    """``TANDEM_KDA_LOW_RANK_BLOCK_C`` (blank: 256); anything but a power of two in [16, 256] is an error naming it."""
    raw = os.environ.get("TANDEM_KDA_LOW_RANK_BLOCK_C", "").strip() or str(LOW_RANK_BLOCK_CS[-1])
    if raw not in (caps := [str(c) for c in LOW_RANK_BLOCK_CS]):
        raise ValueError(f"TANDEM_KDA_LOW_RANK_BLOCK_C must be {', '.join(caps[:-1])} or {caps[-1]}, got {raw!r}")
    return int(raw)


LOW_RANK_BLOCK_C = low_rank_block_c_from_env()
"""The up-projections' channels a program in the conv's launch (``LowRankUp.max_block_c``). At 256 that launch is
255 registers with 736 bytes of spills at Kimi's shape (ptxas sm_90a); the in_proj + conv launch takes 64 for its
register count (kernels/short_conv/in_proj_conv.py). The same bits at any cap. At 64 a b1 step was within the
run-to-run spread on an H100 (docs/PERFORMANCE.md, forty-first session), so 256 stays.
``TANDEM_KDA_LOW_RANK_BLOCK_C``: A / B runs."""


__all__ = [
    "CONV_PLANES",
    "DECODE_GATE_IN_KERNEL",
    "FLA_CONV_MIN_LEN",
    "GATE_IN_CHUNK",
    "LOW_RANK_BLOCK_C",
    "LOW_RANK_IN_CONV",
    "LOW_RANK_MAX_ROWS",
    "PLANES_MIN_LEN",
    "low_rank_block_c_from_env",
]
