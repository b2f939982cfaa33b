"""The device-resident eager decode step (``AttentionCache.extend`` of at most one row per sequence, no ``undo``:
device lengths advanced in place, the static step's math on the fed sequences) against the host-planned path of
the same call (``undo=True`` forces it), per layer kind, with sequences left out of some steps, a multi-row call
and a rollback between decode steps.

Rule (fp32): ``max|device - host| <= 1e-5 * max(1, max|host|)`` per step, and every decoded row within the same
bound of the training forward of the whole sequence.
"""

from __future__ import annotations

import pytest
import torch
from test_decode_cache import assert_rows_close, full_forward, make_layer

from dsv4_attention import LayerKind
from dsv4_attention.decode import AttentionCache, ExtendPlan

# prompts around the window (8), ratio-4 blocks and the first ratio-128 block
PROMPTS = [1, 3, 8, 126, 127]
# per step, which sequences are fed (a count of 0: a finished sequence); a 2 is a multi-row call
SCHEDULE = [
    (1, 1, 1, 1, 1),
    (1, 0, 1, 0, 1),
    (0, 1, 1, 1, 0),
    (2, 1, 2, 1, 2),
    (1, 1, 1, 1, 1),
    (1, 0, 0, 1, 1),
    (1, 1, 1, 1, 1),
]


@pytest.mark.parametrize("kind", list(LayerKind), ids=lambda k: k.name)
def test_device_decode_step_equals_host_planned_step(kind):
    layer = make_layer(kind, seed=5)
    fed = [p + sum(step[b] for step in SCHEDULE) + 2 for b, p in enumerate(PROMPTS)]
    xs = [torch.randn(n, 64) for n in fed]
    device, host = (AttentionCache(layer, len(PROMPTS), max(fed)) for _ in range(2))
    prompt = ExtendPlan((0,) * len(PROMPTS), tuple(PROMPTS))
    rows = torch.cat([x[:p] for x, p in zip(xs, PROMPTS)])
    for cache in (device, host):
        cache.extend(layer, rows, prompt)
    outputs: list[list[torch.Tensor]] = [[] for _ in PROMPTS]
    for step, counts in enumerate(SCHEDULE):
        plan = ExtendPlan(device.lengths, counts)
        x = torch.cat([xs[b][n : n + k] for b, (n, k) in enumerate(zip(plan.lengths, counts))])
        got = device.extend(layer, x, plan)
        want = host.extend(layer, x, plan, undo=True)
        assert_rows_close(f"{kind.name} step {step} {counts}", got, want)
        for b, (a, e) in enumerate(zip(plan.row_starts, plan.row_starts[1:])):
            outputs[b].append(got[a:e])
    assert device.lengths == host.lengths
    assert device.device_lengths(torch.device("cpu")).tolist() == list(device.lengths)
    # an undo call on the device cache, its rollback, then device steps again: still the host path's rows
    plan = ExtendPlan(device.lengths, (2,) * len(PROMPTS))
    x = torch.cat([xs[b][n : n + 2] for b, n in enumerate(plan.lengths)])
    kept = tuple(n + b % 2 for b, n in enumerate(plan.lengths))  # keep 0 or 1 of the 2 rows
    for cache in (device, host):
        cache.extend(layer, x, plan, undo=True)
        cache.rollback(kept)
    plan = ExtendPlan(device.lengths, (1,) * len(PROMPTS))
    x = torch.stack([xs[b][n] for b, n in enumerate(plan.lengths)]) * 0.5
    assert_rows_close(
        f"{kind.name} after rollback", device.extend(layer, x, plan), host.extend(layer, x, plan, undo=True)
    )
    for b, (x, p) in enumerate(zip(xs, PROMPTS)):
        n = p + sum(step[b] for step in SCHEDULE)
        full = full_forward(layer, x[:n])[p:]  # [decoded rows, d]
        assert_rows_close(f"{kind.name} sequence {b}", torch.cat(outputs[b]), full)
