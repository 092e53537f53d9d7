"""The one rule every CUDA graph set follows at capture: a failure means eager steps.

A capture can fail for reasons outside the engine's control (an op that syncs with the
host, a driver or memory limit). The graphs are an optimization, so a failure is logged
once with what runs eagerly instead, the device is synchronized so the failed capture's
work is done, and the engine goes on without that set of graphs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)


def captured(capture: Callable[[], None], failure: str) -> bool:
    """Run ``capture``; on any exception log ``failure`` (what failed, and what runs
    eagerly instead) with the reason, synchronize the device and return ``False``."""
    try:
        capture()
    except Exception as exc:  # noqa: BLE001 - any capture failure means: run eagerly
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        log.warning("%s: %s", failure, exc)
        return False
    return True
