"""How the MoE gate-up kernels compile for the H200 (sm_90a), on a host without a GPU: Triton's ``compile`` with a
CUDA target, then ptxas ``-v`` — registers a thread, spills, shared memory, and which copy / MMA instructions
the PTX uses (``cp.async`` vs the TMA's ``cp.async.bulk.tensor``, ``wgmma``, ``setmaxnreg`` for warp
specialisation).

    python -m bench.sm90_report

Triton's own ptxas is used (its ``ptxas-blackwell`` where present: the plain one may predate sm_90a's PTX).
The pointer kernel at the engine's tile: 255 registers, 192 KB of shared memory, operands by ``cp.async``; the
TMA variant (kernels/moe/prefill_tma.py): 172 registers, the weights by ``cp.async.bulk.tensor`` — and
``warp_specialize`` left the PTX unchanged (Triton 3.9). These are compile facts, not timings:
``python -m bench.moe_gate_up_tma`` on the GPU times them.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels.moe import prefill, prefill_tma

INSTRUCTIONS = ("wgmma.mma_async", "cp.async.bulk.tensor", "cp.async.cg", "setmaxnreg")
_COMMON = {"X": "*bf16", "TOKEN": "*i64", "ENDS": "*i32", "TILE_E": "*i32", "TILE_ROW": "*i32"}
_TILE = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "EVEN_K": True, "DOT_F32": False, "PREC": "tf32"}


def _ptxas() -> str:
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    for name in ("ptxas-blackwell", "ptxas"):
        if (bin_dir / name).exists():
            return str(bin_dir / name)
    raise FileNotFoundError(f"no ptxas under {bin_dir}")


def report(fn, signature: dict, constexprs: dict, aligned: tuple[str, ...], num_warps: int, num_stages: int) -> dict:
    """Compile ``fn`` for sm_90a; pointer / integer arguments in ``aligned`` are declared 16-divisible (as
    Triton's launcher specialises them for aligned tensors and strides)."""
    names = list(signature)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    for k in constexprs:
        signature[k] = "constexpr"
    kernel = triton.compile(
        ASTSource(fn, signature, constexprs=constexprs, attrs=attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps, "num_stages": num_stages},
    )
    ptx = kernel.asm["ptx"]
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        out = subprocess.run(
            [_ptxas(), "-v", "--gpu-name", "sm_90a", str(src), "-o", str(Path(d) / "k.o")],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    regs = re.search(r"Used (\d+) registers", out)
    spills = re.search(r"(\d+) bytes spill stores", out)
    return {
        "registers": int(regs.group(1)) if regs else None,
        "spill_store_bytes": int(spills.group(1)) if spills else 0,
        "shared_bytes": kernel.metadata.shared,
        **{name: ptx.count(name) for name in INSTRUCTIONS},
    }


def cases() -> dict[str, dict]:
    ints = ("H", "INTER")
    pointer_sig = _COMMON | {"W13": "*bf16", "A": "*bf16", "H": "i32", "INTER": "i32", "up_offset": "i32"}
    pointer_sig |= {n: "i32" for n in ("num_n", "stride_x", "stride_we", "stride_wn", "stride_a")}
    pointer_aligned = (*_COMMON, "W13", "A", *ints, "up_offset", "stride_x", "stride_we", "stride_wn", "stride_a")
    out = {}
    for stages in (3, 4):
        out[f"gate-up pointer, {stages} stages"] = report(
            prefill._gate_up_tiles_kernel, dict(pointer_sig), dict(_TILE), pointer_aligned, 8, stages
        )
    tma_sig = _COMMON | {"W_DESC": "tensordesc<bf16[128, 64]>", "A": "*bf16", "H": "i32", "INTER": "i32"}
    tma_sig |= {n: "i32" for n in ("num_n", "stride_x", "stride_a")}
    for stages in (3, 4):
        for ws in (False, True):
            ce = dict(_TILE) | {"NUM_STAGES": stages, "WARP_SPECIALIZE": ws}
            name = f"gate-up TMA weights, {stages} stages{', warp_specialize' if ws else ''}"
            out[name] = report(
                prefill_tma._gate_up_tma_kernel,
                dict(tma_sig),
                ce,
                (*_COMMON, "A", *ints, "stride_x", "stride_a"),
                8,
                stages,
            )
    return out


def main() -> int:
    rows = cases()
    print(f"Triton {triton.__version__}, sm_90a, 128 x 128 x 64 tiles, 8 warps\n")
    print("| kernel | registers | spill stores (B) | shared (KB) | " + " | ".join(INSTRUCTIONS) + " |")
    print("|---" * (4 + len(INSTRUCTIONS)) + "|")
    for name, r in rows.items():
        cells = [str(r["registers"]), str(r["spill_store_bytes"]), f"{r['shared_bytes'] / 1024:.0f}"]
        print(f"| {name} | " + " | ".join(cells + [str(r[i]) for i in INSTRUCTIONS]) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
