"""Markdown tables of the mid-shape benchmark's JSON result."""

from __future__ import annotations

from typing import Any


def _f(x: Any, fmt: str = ".2f", scale: float = 1.0) -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    return format(x * scale, fmt)


def _table(head: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def _hf_cell(hf: dict[str, Any] | None, key: str, fmt: str, scale: float = 1.0) -> str:
    if hf is None:
        return "not run"
    if "error" in hf:
        return hf["error"][:80]
    return _f(hf.get(key), fmt, scale)


def _first_step(f: dict[str, float] | None) -> list[str]:
    """Eager vs graph logits of the first decode step (older result files lack them)."""
    if not f:
        return ["-", "-", "-"]
    diff = f"{f['max_abs_diff']:.3g} (of {f['max_abs_logit']:.3g})"
    return [diff, f"{f['min_top2_gap']:.3g}", _f(f["argmax_equal"], ".1%")]


def render(res: dict[str, Any]) -> str:
    parts = [f"## Mid-shape benchmark ({res['device']}, {res['model']})"]
    c = res["ceilings"]
    parts.append(
        _table(
            ["measured ceiling", "value"],
            [
                [
                    f"matmul {c['matmul']['dtype']} n={c['matmul']['n']}",
                    f"{c['matmul']['flops_per_s'] / 1e12:.1f} TFLOP/s",
                ],
                [f"copy {c['copy']['bytes'] >> 20} MiB", f"{c['copy']['bytes_per_s'] / 1e12:.2f} TB/s (read + write)"],
            ],
        )
    )
    hf_all = res.get("hf") or {}
    rows = []
    for p in res["prefill"]:
        hf = (hf_all.get("prefill") or {}).get(str(p["length"]))
        ratio = "-" if not hf or "error" in hf else f"{p['tokens_per_s'] / hf['tokens_per_s']:.2f}x"
        rows.append(
            [
                str(p["length"]),
                _f(p["tokens_per_s"], ",.0f"),
                _f(p["seconds"], ".1f", 1e3),
                _f(p["flops"]["total"] / p["seconds"], ".1f", 1e-12),
                _f(p["mfu"], ".1%"),
                _hf_cell(hf, "tokens_per_s", ",.0f"),
                ratio,
            ]
        )
    parts.append(_table(["prompt", "Tandem tok/s", "ms", "model TFLOP/s", "MFU", "HF tok/s", "Tandem / HF"], rows))
    if res.get("prefill_graphs"):
        rows = [
            [
                str(p["length"]),
                _f(p["seconds"], ".1f", 1e3),
                _f(p["eager_seconds"], ".1f", 1e3),
                f"{p['eager_seconds'] / p['seconds']:.2f}x",
                _f(p["mfu"], ".1%"),
                f"{p['max_abs_logit_diff']:.3g}",
                str(p["argmax_equal"]),
            ]
            for p in res["prefill_graphs"]
        ]
        head = ["prompt", "piecewise graphs ms", "eager ms", "speedup", "MFU", "logits max |diff|", "argmax equal"]
        parts.append(_table(head, rows))
    rows = []
    for d in res["decode"]:
        hf = (hf_all.get("decode") or {}).get(f"{d['ctx']},{d['batch']}")
        ratio = "-" if not hf or "error" in hf else f"{hf['step_seconds'] / d['step_seconds']:.2f}x"
        rows.append(
            [
                str(d["ctx"]),
                str(d["batch"]),
                _f(d["step_seconds"], ".2f", 1e3),
                _f(d["batch"] / d["step_seconds"], ",.0f"),
                _f(d["bytes"]["total"], ".2f", 1e-9),
                _f(d["bytes_per_s"], ".2f", 1e-12),
                _f(d["roofline"], ".1%"),
                _hf_cell(hf, "step_seconds", ".2f", 1e3),
                ratio,
            ]
        )
    parts.append(
        _table(
            ["ctx", "batch", "step ms", "tok/s", "GB/step", "TB/s", "of copy BW", "HF step ms", "Tandem speed-up"],
            rows,
        )
    )
    rows = []
    for name, b in res.get("breakdown", {}).items():
        tot = b["total"] or 1.0
        cells = [f"{b[g]:.2f} ({b[g] / tot:.0%})" for g in ("attention", "KDA", "MoE", "GEMM", "other")]
        rows.append([name, *cells, f"{b['total']:.2f}"])
    if rows:
        parts.append(_table(["ms (share)", "attention", "KDA", "MoE", "GEMM", "other", "total"], rows))
    rows = [
        [
            mode,
            str(o["batch"]),
            str(o["ctx"]),
            _f(o["wall_ms"]),
            _f(o["gpu_ms"]),
            _f(o["overhead_ms"]),
            _f(o["overhead_fraction"], ".1%"),
            _f(o.get("replay_ms")),
            _f(o.get("overhead_vs_replay"), ".1%"),
        ]
        for mode, o in (
            ("eager", res.get("overhead")),
            ("CUDA graph", res.get("overhead_graph")),
            ("CUDA graph, overlapped", res.get("overhead_async")),
        )
        if o
    ]
    if rows:
        head = ["decode", "batch", "ctx", "step wall ms", "GPU kernel ms", "host overhead ms", "overhead / GPU"]
        head += ["graph replay ms", "(wall - replay) / replay"]
        parts.append(_table(head, rows))
    g = res.get("graphs")
    if g:
        rows = [
            [
                str(r["ctx"]),
                str(r["batch"]),
                _f(r["eager_ms"]),
                _f(r["graph_ms"]),
                _f(r["eager_ms"] / r["graph_ms"] if r.get("graph_ms") else None),
                _f(r["token_agreement"], ".1%"),
                _f(r.get("async_ms")),
                _f(r.get("async_median_ms")),
                _f(r.get("token_agreement_async"), ".1%"),
                *_first_step(r.get("first_step_logits")),
            ]
            for r in g
        ]
        head = ["ctx", "batch", "eager ms", "graph ms", "speed-up", "tokens equal", "overlapped ms"]
        head += ["overlapped median ms", "tokens equal"]
        head += ["step-1 max logit diff", "step-1 min top-2 gap", "step-1 argmax equal"]
        parts.append(_table(head, rows))
    for note in res.get("notes", []):
        parts.append(f"- {note}")
    return "\n\n".join(parts)
