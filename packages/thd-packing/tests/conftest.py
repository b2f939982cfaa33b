"""Hypothesis profile of the thd-packing tests; makes ``_thd_packing_helpers`` importable (also in spawned gloo
workers) under ``--import-mode=importlib``."""

from __future__ import annotations

import os
import sys

from hypothesis import HealthCheck, settings

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

settings.register_profile(
    "thd", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.load_profile("thd")
