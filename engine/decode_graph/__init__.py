"""Decode steps on static, padded input buffers, replayed as CUDA graphs (eagerly on the host, for tests).

``DecodeGraphs`` (graphs.py) runs pure-decode steps: ``StaticDecodeBuffers`` (buffers.py) holds every input a
step needs at the largest batch size, and a step fills them once (no per-layer host work) and describes them
to the backends through ``DecodeMeta`` (meta.py) on the ForwardBatch.
"""

from engine.decode_graph.graphs import DecodeGraphs, default_batch_sizes
from engine.decode_graph.meta import DecodeMeta

__all__ = ["DecodeGraphs", "DecodeMeta", "default_batch_sizes"]
