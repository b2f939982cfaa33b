"""``count_ops`` on toy code with known counts: every kind of host sync, upload and op, charged to module scopes."""

from __future__ import annotations

import torch

from hybrid_model.generation.op_count import count_ops, total


class _Syncing(torch.nn.Module):
    """3 syncs (``.item()``, ``bool()`` of a tensor, a boolean-mask index) and 1 upload (``torch.tensor``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = x.sum().item()  # sync
        if bool(x[0] > -100):  # sync
            x = x * scale
        x = x[x > 0]  # sync: data-dependent shape
        return x + torch.tensor([1.0])  # upload (broadcast add)


class _DeviceOnly(torch.nn.Module):
    """No sync, no upload: everything stays on the device."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = torch.arange(x.shape[0], device=x.device)
        return torch.where(x > 0, x, 0.0) + w


def test_toy_counts_per_scope():
    syncing, device_only = _Syncing(), _DeviceOnly()
    x = torch.tensor([1.0, -2.0, 3.0])  # (outside the block: not counted)
    with count_ops({syncing: "syncing", device_only: "device"}) as counts:
        device_only(x)
        syncing(x)
        rows = x.tolist()  # sync, charged to "other"
        host = x.cpu()  # sync
        host.tolist()  # a host copy: no second sync
        int(host[0])  # nor this one
    assert rows == [1.0, -2.0, 3.0]
    assert (counts["syncing"].syncs, counts["syncing"].uploads) == (3, 1)
    assert (counts["device"].syncs, counts["device"].uploads) == (0, 0)
    assert counts["device"].ops == 5  # arange, gt, scalar_tensor (the 0.0), where, add
    assert (counts["other"].syncs, counts["other"].uploads) == (2, 0)
    assert sum(counts["syncing"].sites.values()) == 4  # every event keeps its call site
    assert any(site.startswith("sync test_op_count.py:") for site in counts["syncing"].sites)
    whole = total(counts)
    assert (whole.syncs, whole.uploads) == (5, 1)


def test_nested_scopes_and_restored_methods():
    inner = _Syncing()
    outer = torch.nn.Sequential(inner)
    tolist = torch.Tensor.tolist
    with count_ops({outer: "outer", inner: "inner"}) as counts:
        outer(torch.ones(2))
        torch.ones(3).nonzero()  # sync outside every scope
        torch.ones(2).repeat_interleave(torch.tensor([1, 2]))  # upload + sync (no output_size)
        torch.ones(2).repeat_interleave(torch.tensor([1, 2]), output_size=3)  # upload only
    assert counts["inner"].syncs == 3 and "outer" not in counts  # the innermost scope gets the events
    assert (counts["other"].syncs, counts["other"].uploads) == (2, 2)
    assert torch.Tensor.tolist is tolist  # patches undone
