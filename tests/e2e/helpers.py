"""Helpers for end-to-end tests against real processes on localhost."""

from __future__ import annotations

import re
import signal
import threading
import time
import urllib.request

import openai

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


def kill_prefill_mid_stream(c: LocalCluster, model: str, prompt: list[int]) -> None:
    """A completion through the router whose prefill worker is SIGKILLed while its handoff streams: the
    client gets a 502/503 within 2 s, and the decode worker holds no page or slot 2 s later."""
    client = openai.OpenAI(base_url=c.base_url, api_key="none", max_retries=0, timeout=30)
    result: dict = {}

    def call() -> None:
        try:
            client.completions.create(model=model, prompt=prompt, max_tokens=4)
            result["ok"] = True
        except openai.APIError as e:
            result["error"] = e
        result["t"] = time.monotonic()

    th = threading.Thread(target=call)
    th.start()
    deadline = time.monotonic() + 10
    while scrape(c.worker("prefill").metrics_port)["tandem_prefill_live_transfers"] < 1:
        assert time.monotonic() < deadline, "prefill never started"
        time.sleep(0.01)
    time.sleep(0.2)
    next(x for x in c.procs if x.name.startswith("prefill")).popen.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    th.join(10)
    assert "error" in result, result
    assert result["t"] - killed < 2.0, f"error after {result['t'] - killed:.2f} s"
    assert result["error"].status_code in (502, 503), result["error"]
    deadline = time.monotonic() + 2
    while (m := scrape(c.worker("decode").metrics_port))["tandem_decode_pages_in_use"] or m[
        "tandem_decode_slots_in_use"
    ]:
        assert time.monotonic() < deadline, m
        time.sleep(0.02)
