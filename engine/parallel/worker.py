"""Entry point of ranks 1..world-1: ``python -m engine.parallel.worker RANK PORT CONFIG`` (started by rank 0)."""

from __future__ import annotations

import sys

from engine.parallel.launcher import worker_main

if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
