"""Triton kernels compiled for the H200 (sm_90) on a machine without a GPU, as the launches the host tests make.

The interpreter (``TRITON_INTERPRET=1``) runs a kernel's Python on numpy; it never runs Triton's code generator, so
a kernel the host tests pass can still fail to compile on the GPU: a helper whose branches return different types,
a construct the compiler rejects. (The twenty-sixth session's MoE pair rows did, and a GPU session learned it only
as a compile error.) Triton compiles without a GPU when it is given the target: its wheel carries ptxas.

``record_launches()`` keeps each interpreted launch's kernel, argument types and constexprs, as Triton's JIT would
specialise them (deduplicated); ``compile_errors(launches)`` compiles each one to a cubin for sm_90 in a child
process whose kernels are compiled-mode (``TRITON_INTERPRET`` unset) and returns what failed, and any launch whose
PTX has a half-precision FMA (a rounding the kernel meant, skipped by Triton's FP fusion). Each is compiled in the
form a GPU launch takes (``as_on_the_gpu``): a bf16 ``tl.dot`` on the tensor cores, not the interpreter's fp32
upcast (until the thirty-eighth session the bf16 launches were compiled in the interpreter's form).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

TARGET = ("cuda", 90, 32)  # the H200: compute capability 9.0, warps of 32
_DTYPES = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "i1",
}
_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "launch_pdl", "enable_fp_fusion")


@dataclass(frozen=True)
class Launch:
    """One kernel specialisation: the module and name of the ``@triton.jit`` function, each parameter's Triton type
    (``"*bf16"``, ``"i32"``, ``"constexpr"``) and the constexprs' values, the compile options."""

    module: str
    kernel: str
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[str, object], ...]
    options: tuple[tuple[str, object], ...]


def _is_constexpr(p: inspect.Parameter) -> bool:
    ann = p.annotation  # a string under ``from __future__ import annotations``
    return ann is not inspect.Parameter.empty and (
        getattr(ann, "__name__", None) == "constexpr" or str(ann).endswith("constexpr")
    )


def _arg_type(value: object) -> tuple[str, object] | None:
    """(Triton type, constexpr value or None) as the JIT specialises an argument; None: not a kind compiled here."""
    if value is None:
        return "constexpr", None
    if isinstance(value, torch.Tensor):
        return (f"*{_DTYPES[value.dtype]}", None) if value.dtype in _DTYPES else None
    if isinstance(value, bool):
        return "i1", None
    if isinstance(value, int):
        if value == 1:  # Triton's JIT turns an int argument equal to 1 into a constexpr
            return "constexpr", 1
        return ("i32" if -(2**31) <= value < 2**31 else "i64"), None
    if isinstance(value, float):
        return "fp32", None
    return None


def launch_of(fn, args: tuple, kwargs: dict) -> Launch | None:
    """The ``Launch`` of calling the (interpreted) kernel ``fn`` with these arguments; None where an argument is of
    a kind this check does not compile (a TMA descriptor)."""
    raw = fn.fn
    params = inspect.signature(raw).parameters
    bound = inspect.signature(raw).bind(*args, **{k: v for k, v in kwargs.items() if k in params})
    bound.apply_defaults()
    signature, constexprs = [], []
    for name, value in bound.arguments.items():
        if _is_constexpr(params[name]):
            if not isinstance(value, (str, int, float, bool, type(None))):
                return None  # e.g. a tl.dtype: not carried to the child process
            signature.append((name, "constexpr"))
            constexprs.append((name, value))
            continue
        typed = _arg_type(value)
        if typed is None:
            return None
        signature.append((name, typed[0]))
        if typed[0] == "constexpr":
            constexprs.append((name, typed[1]))
    options = tuple((k, kwargs[k]) for k in _OPTIONS if k in kwargs)
    return Launch(raw.__module__, raw.__name__, tuple(signature), tuple(constexprs), options)


@contextlib.contextmanager
def record_launches() -> Iterator[set[Launch]]:
    """Every interpreted launch while open, as a set of ``Launch``es (the kernels still run)."""
    from triton.runtime.interpreter import InterpretedFunction

    seen: set[Launch] = set()
    run = InterpretedFunction.run

    def recording(self, *args, grid, warmup, **kwargs):
        launch = launch_of(self, args, kwargs)
        if launch is not None:
            seen.add(launch)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording
    try:
        yield seen
    finally:
        InterpretedFunction.run = run


def compile_errors(launches: set[Launch] | list[Launch], timeout: float = 600.0) -> list[str]:
    """Compile each launch for sm_90 in a child process; 'module.kernel (constexprs): error' for each that fails."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    payload = json.dumps([asdict(x) for x in sorted(launches, key=repr)])
    proc = subprocess.run(
        [sys.executable, "-m", "tests.kernels.sm90_compile"], input=payload, capture_output=True, text=True,
        env=env, timeout=timeout,
    )  # fmt: skip
    if proc.returncode != 0:
        return [f"the compile process failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}"]
    return json.loads(proc.stdout.strip().splitlines()[-1])


_LOOP = re.compile(r"(\$L__BB\d+_\d+):[^\n]*\n((?:(?!\$L__BB).)*?)bra\s+\1;", re.DOTALL)


def loop_bodies(ptx: str) -> list[str]:
    """The bodies of PTX blocks that branch back to their own label with no label between: a wait's poll loop."""
    return [m.group(2) for m in _LOOP.finditer(ptx)]


def ptx_of(launch: Launch, timeout: float = 300.0) -> str:
    """The sm_90 PTX of one launch as recorded (no PDL variant), compiled in a child process."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.kernels.sm90_compile", "--ptx"], input=json.dumps([asdict(launch)]),
        capture_output=True, text=True, env=env, timeout=timeout,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"the compile process failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])[0]


def registers_of(ptx: str) -> tuple[int, int]:
    """(registers a thread, bytes of spill stores) of an sm_90a PTX, from the ptxas in Triton's wheel: a launch's
    register count sets how many of its programs share an SM."""
    import triton

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    exe = next(p for p in (bin_dir / "ptxas-blackwell", bin_dir / "ptxas") if p.exists())
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        proc = subprocess.run([str(exe), "-v", "-arch=sm_90a", str(src), "-o", str(Path(tmp) / "k.o")],
                              capture_output=True, text=True, check=True)  # fmt: skip
    regs = re.findall(r"Used (\d+) registers", proc.stderr)
    spills = re.findall(r"(\d+) bytes spill stores", proc.stderr)
    return int(regs[-1]), int(spills[-1]) if spills else 0


def _source(x: dict, constexprs: dict):
    """Triton's compile source of a recorded launch with these constexpr values."""
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(x["module"]), x["kernel"])
    names = [name for name, _ in x["signature"]]
    return ASTSource(fn, dict(x["signature"]), {(names.index(k),): v for k, v in constexprs.items()})


def _ptx(x: dict) -> str:
    import triton
    from triton.backends.compiler import GPUTarget

    src = _source(x, as_on_the_gpu(x))
    return triton.compile(src, target=GPUTarget(*TARGET), options=dict(x["options"])).asm["ptx"]


_HALF_POINTERS = ("*bf16", "*fp16")


def as_on_the_gpu(x: dict) -> dict:
    """The recorded constexprs as a GPU launch specialises them. Under the interpreter ``dot_config`` upcasts
    ``tl.dot``'s operands to fp32 (``DOT_F32``, "ieee": its bf16 dot is wrong there); on the GPU half-precision
    operands go to the tensor cores as they are (``DOT_F32`` off, "tf32"), fp32 ones keep "ieee". A kernel's dot
    operands share the dtype of its half pointers where it has any (the models run in one dtype)."""
    constexprs = dict(x["constexprs"])
    if constexprs.get("DOT_F32") is True and constexprs.get("PREC") == "ieee":
        half = any(kind in _HALF_POINTERS for _, kind in x["signature"])
        constexprs.update(DOT_F32=False, PREC="tf32" if half else "ieee")
    return constexprs


def _variants(x: dict) -> list[tuple[dict, dict]]:
    """(constexprs, options) to compile: as a GPU launch specialises the recorded one (``as_on_the_gpu``), and
    with PDL on where the kernel takes it (the host never launches with PDL: kernels/pdl.py), with the weight's L2
    prefetch before the wait where it has one."""
    constexprs, options = as_on_the_gpu(x), dict(x["options"])
    out = [(constexprs, options)]
    if constexprs.get("USE_PDL") is False:
        on = {**constexprs, "USE_PDL": True}
        if on.get("PDL_PREFETCH") is False and on.get("ONE_ROW", True):
            on["PDL_PREFETCH"] = True
        out.append((on, {**options, "launch_pdl": True}))
    return out


_SKIPPED_ROUNDING = ("fma.rn.bf16", "fma.rn.f16")
"""Half-precision FMAs: LLVM's contraction of a product rounded to bf16 / fp16 and the sum after it, which skips the
product's rounding (Triton's FP fusion; found in the thirty-fourth session's Qwen3 kernel)."""


def _compile(x: dict) -> list[str]:
    import triton
    from triton.backends.compiler import GPUTarget

    errors = []
    for constexprs, options in _variants(x):
        src = _source(x, constexprs)
        try:
            ptx = triton.compile(src, target=GPUTarget(*TARGET), options=options).asm["ptx"]
            # our kernels keep fp32 between the roundings they mean: a half-precision FMA skipped one
            skipped = [op for op in _SKIPPED_ROUNDING if op in ptx]
            errors += [f"{x['module']}.{x['kernel']} {constexprs}: {op} in the PTX" for op in skipped]
        except Exception as e:  # each failure is reported with its kernel; none stops the others
            why = []  # Triton's CompilationError names the call site; its cause says what is wrong inside it
            while e is not None:
                why.append(f"{type(e).__name__}: {str(e).strip()[-800:]}")
                e = e.__cause__
            errors.append(f"{x['module']}.{x['kernel']} {constexprs}: " + "\n  caused by ".join(why))
    return errors


def main() -> None:
    """Child: compile the launches read from stdin (JSON), print the errors (``--ptx``: the PTX) as one JSON line."""
    launches = json.loads(sys.stdin.read())
    if sys.argv[1:] == ["--ptx"]:
        print(json.dumps([_ptx(x) for x in launches]))
        return
    print(json.dumps([err for x in launches for err in _compile(x)]))


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("tests.kernels.sm90_compile compiles kernels: run it without TRITON_INTERPRET=1")
    main()
