"""warm_workers.run_warm: gloo workers forked from the warm server behave as spawned ones (results in rank order, the
caller's environment at the call, one thread, a failing rank's traceback raised in the caller)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from warm_workers import fail_on, probe, run_warm

pytestmark = pytest.mark.distributed


def test_workers_see_the_callers_environment_at_the_call_and_one_thread(monkeypatch):
    monkeypatch.setenv("DSV4_WARM_PROBE", "first")
    first = run_warm(probe, 2, "DSV4_WARM_PROBE")  # starts the server with this environment
    monkeypatch.setenv("DSV4_WARM_PROBE", "second")  # changed after the server started
    second = run_warm(probe, 3, "DSV4_WARM_PROBE")
    assert first == [(r, 2, "first", 1, 1.0) for r in range(2)]
    assert second == [(r, 3, "second", 1, 3.0) for r in range(3)]


def test_a_failing_rank_raises_its_traceback_in_the_caller():
    with pytest.raises(RuntimeError, match="rank 1 fails on purpose") as info:
        run_warm(fail_on, 2, 1, timeout=120)
    assert "--- rank 1 ---" in str(info.value) and "--- rank 0 ---" not in str(info.value)
