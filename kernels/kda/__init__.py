from kernels.kda.fla_adapter import chunk_kda_varlen, fla_available, fused_recurrent_kda_slots
from kernels.kda.naive import kda_gate, l2norm, naive_chunk_kda, naive_recurrent_kda

# fla_adapter imports fla inside its functions only, so importing this package never needs fla.
__all__ = [
    "chunk_kda_varlen",
    "fla_available",
    "fused_recurrent_kda_slots",
    "kda_gate",
    "l2norm",
    "naive_chunk_kda",
    "naive_recurrent_kda",
]
