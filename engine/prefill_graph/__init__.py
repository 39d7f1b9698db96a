"""Prefill and mixed steps as piecewise CUDA graphs (vLLM's piecewise graphs, without torch.compile).

A prefill step launches hundreds of kernels; at 8k tokens the host needs longer to launch them than the GPU
to run them. ``PrefillGraphs`` (graphs.py) pads a step's rows up to a token bucket and replays everything that
is row-wise (embedding, norms, projections, gates, MoE) as CUDA graph pieces captured once per bucket. What
depends on the step's sequence layout runs eagerly between the pieces, on the real rows only: the cores
(attention and its KV write, the KDA short conv and recurrence; pieces.py) and the per-layer hooks.
"""

from engine.prefill_graph.graphs import PrefillGraphs, default_token_buckets

__all__ = ["PrefillGraphs", "default_token_buckets"]
