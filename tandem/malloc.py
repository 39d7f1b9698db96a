"""glibc malloc settings for worker processes.

The engine allocates and frees activation-sized buffers every step. With glibc's defaults those
above the dynamic mmap threshold are mmap'ed and unmapped each time and the heap is trimmed eagerly,
so an 8k-token CPU prefill spent more time in page faults than computing (bench/pd_ttft.py: 8k TTFT
1.8-2.7x lower tuned). One arena because the engine runs on a non-main thread.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8


def tune_malloc() -> bool:
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        ok = all(
            libc.mallopt(param, value)
            for param, value in (
                (_M_MMAP_THRESHOLD, 32 << 20),  # glibc's ceiling on 64-bit
                (_M_TRIM_THRESHOLD, 1 << 30),
                (_M_ARENA_MAX, 1),
            )
        )
    except (OSError, AttributeError):  # not glibc
        return False
    if not ok:
        logger.info("mallopt refused a setting; running with glibc defaults")
    return ok
