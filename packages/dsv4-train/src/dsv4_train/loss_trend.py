"""Whether a run's loss is falling: the end-of-run summary of ``dsv4 train``."""

from __future__ import annotations

import math

#: fewer finite losses than this: the trend is not told
MIN_STEPS_FOR_TREND = 4


def loss_trend(metrics: list[dict], key: str = "lm_loss") -> str:
    """``"falling"`` / ``"NOT falling"`` (the mean of the last fifth of the finite losses against the first), or
    ``"too few steps to tell"`` below :data:`MIN_STEPS_FOR_TREND` finite losses."""
    vals = [m[key] for m in metrics if key in m and m[key] is not None and math.isfinite(m[key])]
    if len(vals) < MIN_STEPS_FOR_TREND:
        return "too few steps to tell"
    k = max(1, len(vals) // 5)
    return "falling" if sum(vals[-k:]) / k < sum(vals[:k]) / k else "NOT falling"


def loss_is_falling(metrics: list[dict], key: str = "lm_loss") -> bool:
    return loss_trend(metrics, key) == "falling"


__all__ = ["MIN_STEPS_FOR_TREND", "loss_is_falling", "loss_trend"]
