from kernels.kda.fla_adapter import chunk_kda_varlen, fla_available, fused_recurrent_kda_slots
from kernels.kda.naive import kda_gate, l2norm, naive_chunk_kda, naive_recurrent_kda
from kernels.kda.recurrent_launch import DEFAULT_RECURRENT_TILE, RecurrentTile, launch_fused_recurrent_kda

# fla_adapter and recurrent_launch import fla inside their functions only, so importing this package never needs fla.
__all__ = [
    "DEFAULT_RECURRENT_TILE",
    "RecurrentTile",
    "chunk_kda_varlen",
    "fla_available",
    "fused_recurrent_kda_slots",
    "kda_gate",
    "l2norm",
    "launch_fused_recurrent_kda",
    "naive_chunk_kda",
    "naive_recurrent_kda",
]
