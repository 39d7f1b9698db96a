"""How the MoE gate-up and MLA decode kernels compile for the H200 (sm_90a), on a host without a GPU: Triton's
``compile`` with a CUDA target, then ptxas ``-v`` — registers a thread, spills, shared memory, and which copy /
MMA instructions the PTX uses (``cp.async`` vs the TMA's ``cp.async.bulk.tensor``, ``wgmma``, ``setmaxnreg``
for warp specialisation).

    python -m bench.sm90_report

Triton's own ptxas is used (its ``ptxas-blackwell`` where present: the plain one may predate sm_90a's PTX).
Compile facts, not timings (``python -m bench.moe_gate_up_tma`` and ``bench/mla_decode_sweep.py`` time them
on the GPU). What it showed with Triton 3.9 (docs/PERFORMANCE.md, sixteenth session):

- gate-up, the engine's pointer kernel: 255 registers, 192 KB of shared memory, operands by ``cp.async``; the
  TMA variant (kernels/moe/prefill_tma.py): 172 registers, the weights by ``cp.async.bulk.tensor``;
  ``warp_specialize`` left the PTX unchanged (also with both operands through TMA), and Triton 3.6 on the
  H200 failed an assertion in its warp-specialization pass, so the variant no longer takes it.
- MLA decode as the engine launches it (heads-major, 32-key tiles, 4 warps): no wgmma (the MMA's M is the 32
  heads), 255 registers and spills; at 16 warps 102 registers and none; keys-major reaches wgmma at 184 KB of
  shared memory.
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
from kernels.paged_attention import mla_decode

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
        out[f"gate-up TMA weights, {stages} stages"] = report(
            prefill_tma._gate_up_tma_kernel,
            dict(tma_sig),
            dict(_TILE) | {"NUM_STAGES": stages},
            (*_COMMON, "A", *ints, "stride_x", "stride_a"),
            8,
            stages,
        )
    out |= down_cases()
    out |= mla_cases()
    return out


def down_cases() -> dict[str, dict]:
    """The down GEMM (a [N, I] sorted rows @ w2[e]^T) at the engine's 128 x 256 x 64 tile, 8 warps: the pointer
    kernel (the engine's fallback; torch's grouped_mm runs by default) and both operands through TMA."""
    tile = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "DOT_F32": False, "PREC": "tf32"}
    base = {"ENDS": "*i32", "TILE_E": "*i32", "TILE_ROW": "*i32"}
    pointer_sig = {"A": "*bf16"} | base | {"W2": "*bf16", "Y": "*bf16"}
    pointer_sig |= {n: "i32" for n in ("H", "INTER", "num_n", "stride_a", "stride_we", "stride_wn", "stride_y")}
    pointer_aligned = ("A", *base, "W2", "Y", "H", "INTER", "stride_a", "stride_we", "stride_wn", "stride_y")
    tma_sig = {"A_DESC": "tensordesc<bf16[128, 64]>"} | base | {"W_DESC": "tensordesc<bf16[256, 64]>", "Y": "*bf16"}
    tma_sig |= {n: "i32" for n in ("H", "INTER", "num_n", "stride_y")}
    out = {}
    for stages in (3, 4):
        out[f"down pointer, {stages} stages"] = report(
            prefill._down_tiles_kernel, dict(pointer_sig), tile | {"EVEN_K": True}, pointer_aligned, 8, stages
        )
        out[f"down TMA both operands, {stages} stages"] = report(
            prefill_tma._down_tma_kernel,
            dict(tma_sig),
            tile | {"NUM_STAGES": stages},
            (*base, "Y", "H", "INTER", "stride_y"),
            8,
            stages,
        )
    return out


def mla_cases() -> dict[str, dict]:
    """Kimi's MLA decode (32 heads, rank 512, rope 64, pages of 16) in three launch forms."""
    sig = {n: "*bf16" for n in ("QL", "QP", "LAT", "OUT")} | {"LSE": "*fp32", "BT": "*i32", "CTX": "*i32"}
    strides = ("stride_ql_b", "stride_ql_h", "stride_qp_b", "stride_qp_h", "stride_lat_p", "stride_lat_s")
    strides += ("stride_o_x", "stride_o_b", "stride_o_h", "stride_l_x", "stride_l_b", "stride_bt")
    sig |= {"qk_scale": "fp32"} | {n: "i32" for n in (*strides, "split_len")}
    dims = {"H": 32, "PAGE_SIZE": 16, "R": 512, "P": 64, "BLOCK_H": 32, "BLOCK_R": 512, "BLOCK_P": 64}
    out = {}
    for keys_major, block_n, warps in ((False, 32, 4), (False, 32, 16), (True, 64, 8)):
        ce = dims | {"BLOCK_N": block_n, "KEYS_MAJOR": keys_major, "SPLIT": True, "DOT_F32": False, "PREC": "tf32"}
        ce |= {"USE_PDL": False}
        form = "keys-major" if keys_major else "heads-major"
        out[f"MLA decode {form}, {block_n}-key tiles, {warps} warps"] = report(
            mla_decode._mla_decode_kernel, dict(sig), ce, (*list(sig)[:7], *strides), warps, 2
        )
    return out


def main() -> int:
    rows = cases()
    print(f"Triton {triton.__version__}, sm_90a; gate-up: 128 x 128 x 64 tiles, 8 warps\n")
    print("| kernel | registers | spill stores (B) | shared (KB) | " + " | ".join(INSTRUCTIONS) + " |")
    print("|---" * (4 + len(INSTRUCTIONS)) + "|")
    for name, r in rows.items():
        cells = [str(r["registers"]), str(r["spill_store_bytes"]), f"{r['shared_bytes'] / 1024:.0f}"]
        print(f"| {name} | " + " | ".join(cells + [str(r[i]) for i in INSTRUCTIONS]) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
