"""What a GPU backend does when a fast path fails at run time (a kernel that does not compile on this GPU, a
library build that refuses it): by default it logs a warning and serves through the slower path from then on,
as vLLM / SGLang degrade. ``TANDEM_KERNEL_FALLBACK=0`` raises instead, so a benchmark or an agreement run never
measures the fallback while it reports the fast path (bench/gpu_session.sh sets it)."""

from __future__ import annotations

import logging

from kernels.env import env_switch

logger = logging.getLogger("tandem.backends")


def fallbacks_allowed() -> bool:
    """``TANDEM_KERNEL_FALLBACK``: ``1`` (default) fall back with a warning, ``0`` raise."""
    return env_switch("TANDEM_KERNEL_FALLBACK", True)


def fall_back(what: str, instead: str, err: BaseException) -> None:
    """Called inside ``except``: warn that ``what`` failed and ``instead`` serves from now on, or re-raise the
    error when fallbacks are off."""
    if not fallbacks_allowed():
        raise RuntimeError(f"{what} failed and TANDEM_KERNEL_FALLBACK=0: {err}") from err
    logger.warning("%s failed (%s); %s", what, err, instead)


__all__ = ["fall_back", "fallbacks_allowed"]
