"""Generate tandem/rpc/*_pb2*.py from proto/*.proto with grpcio-tools.

    python -m tandem.rpc.codegen          # regenerate
    python -m tandem.rpc.codegen --check  # exit 1 if the committed files differ (run by the tests)

Generated code is committed so a reader sees it; the check makes drift a test failure.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "proto"
OUT_DIR = Path(__file__).resolve().parent
PROTOS = ("common.proto", "prefill.proto", "decode.proto", "router.proto")


def generate(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc

    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(PROTO_DIR / p) for p in PROTOS),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    files = sorted(p for p in out_dir.iterdir() if p.name.endswith(("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")))
    for f in files:  # protoc writes top-level imports; make them package imports
        text = re.sub(r"^import (\w+_pb2) as", r"from tandem.rpc import \1 as", f.read_text(), flags=re.M)
        text = re.sub(r"^import (\w+_pb2)$", r"from tandem.rpc import \1", text, flags=re.M)
        f.write_text(text)
    return files


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    if not args.check:
        for f in generate(OUT_DIR):
            print(f"wrote {f.relative_to(ROOT)}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        stale = []
        for f in generate(Path(tmp)):
            committed = OUT_DIR / f.name
            if not committed.is_file() or committed.read_text() != f.read_text():
                stale.append(f.name)
    if stale:
        print(f"generated code is stale: {stale}; run python -m tandem.rpc.codegen", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
