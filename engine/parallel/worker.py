"""Entry point of ranks 1..world-1: ``python -m engine.parallel.worker RANK PORT CONFIG`` (started by rank 0)."""

from __future__ import annotations

import os
import sys

from engine.parallel.launcher import worker_main

if __name__ == "__main__":
    code = worker_main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # nothing left to clean up: skip the interpreter's slow teardown of torch (~0.5 s a rank)
