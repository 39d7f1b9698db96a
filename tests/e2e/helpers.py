"""Helpers for end-to-end tests against real processes on localhost."""

from __future__ import annotations

import re
import time
import urllib.request

from tandem.cluster import LocalCluster


def scrape(port: int) -> dict[str, float]:
    return _parse(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode())


def _parse(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?) ([-+\d.eE]+|NaN)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def in_use(cluster: LocalCluster) -> dict[str, float]:
    """Pages and slots held by every worker, plus live transfers and handoff lanes held."""
    out = {}
    for w in cluster.workers:
        m = scrape(w.metrics_port)
        for k in ("pages_in_use", "slots_in_use", "live_transfers", "outstanding_requests", "handoffs_with_lanes"):
            out[f"{w.role}:{w.port}:{k}"] = m[f"tandem_{w.role}_{k}"]
    return out


def wait_all_free(cluster: LocalCluster, timeout: float) -> tuple[bool, dict[str, float], float]:
    t0 = time.monotonic()
    while True:
        used = in_use(cluster)
        if all(v == 0 for v in used.values()):
            return True, used, time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            return False, used, time.monotonic() - t0
        time.sleep(0.02)
