"""On / off switches read from the environment: ``0`` or ``1`` (blank: the default); anything else is an error that
names the variable, raised where the switch is read (a backend's start), not a silent default."""

from __future__ import annotations

import os


def env_switch(name: str, default: bool) -> bool:
    """The switch ``name``: "1" on, "0" off, unset or blank ``default``."""
    raw = os.environ.get(name, "").strip()
    if raw == "":
        return default
    if raw not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {raw!r}")
    return raw == "1"


__all__ = ["env_switch"]
