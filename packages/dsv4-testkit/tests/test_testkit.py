import socket
import time

import pytest
import torch

import dsv4_testkit.distributed as distributed
from dsv4_testkit import assert_close_to_ref, assert_fully_written, max_abs_err, nan_poison, run_distributed
from dsv4_testkit.distributed import FAILURE_GRACE_S


def test_tolerance_rule_accepts_within_bound_and_rejects_beyond():
    ref = torch.randn(64, dtype=torch.float64)
    low = ref.to(torch.bfloat16)
    assert_close_to_ref("ok", low.float(), ref, low)
    with pytest.raises(AssertionError, match="exceeds"):
        assert_close_to_ref("bad", (ref + 0.5).to(torch.bfloat16), ref, low)


def test_nan_counts_as_infinite_error():
    a = torch.zeros(3)
    b = torch.tensor([0.0, float("nan"), 0.0])
    assert max_abs_err(a, b) == float("inf")


def test_poison_detects_unwritten():
    buf = nan_poison((4, 4))
    buf[:2] = 1.0
    with pytest.raises(AssertionError, match="never written"):
        assert_fully_written("buf", buf)
    buf[2:] = 0.0
    assert_fully_written("buf", buf)
    ibuf = nan_poison((3,), dtype=torch.int32)
    with pytest.raises(AssertionError):
        assert_fully_written("ibuf", ibuf)


def _allreduce(rank, world_size, value):
    t = torch.tensor([float(rank + value)])
    torch.distributed.all_reduce(t)
    return t.item()


@pytest.mark.distributed
def test_run_distributed_gloo_allreduce():
    out = run_distributed(_allreduce, 2, 1.0)
    assert out == [3.0, 3.0]


@pytest.mark.distributed
def test_run_distributed_spawns_again_when_the_port_was_taken(monkeypatch):
    """A port another process took between the pick and rank 0's bind: the workers start again on a new one."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        ports = [taken]
        real = distributed.free_port

        def pick():
            port = ports.pop(0) if ports else real()
            picked.append(port)
            return port

        picked: list[int] = []
        monkeypatch.setattr(distributed, "free_port", pick)
        out = run_distributed(_allreduce, 2, 1.0)
    assert out == [3.0, 3.0]
    assert picked[0] == taken and len(picked) == 2, picked  # one spawn on the taken port, one on a free one


def _tensors(rank, world_size):
    return {"rank": torch.full((3,), float(rank)), "nested": [torch.arange(rank + 1)]}


@pytest.mark.distributed
def test_run_distributed_returns_tensors():
    out = run_distributed(_tensors, 2)
    assert torch.equal(out[1]["rank"], torch.ones(3))
    assert torch.equal(out[1]["nested"][0], torch.arange(2))


def _boom(rank, world_size):
    if rank == 1:
        raise ValueError("rank one failed")
    return rank


@pytest.mark.distributed
def test_run_distributed_reports_rank_errors():
    with pytest.raises(RuntimeError, match="rank one failed"):
        run_distributed(_boom, 2)


def _boom_while_rank0_waits(rank, world_size):
    if rank == 1:
        raise ValueError("rank one failed before the new group")
    # never completes: the new group's rendezvous waits in the store for rank 1 (as megatron's group building does
    # when a peer died first), until gloo's 30 min timeout
    torch.distributed.new_group([0, 1])
    return rank


@pytest.mark.distributed
def test_run_distributed_stops_ranks_left_waiting_for_a_failed_one():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"ranks \[0\] stopped(.|\n)*rank one failed before the new group"):
        run_distributed(_boom_while_rank0_waits, 2, timeout=300)
    # FAILURE_GRACE_S after rank 1's report, not the 300 s timeout (spawns and imports take ~10 s on 2 cores)
    assert time.monotonic() - start < FAILURE_GRACE_S + 60


def test_megatron_cpu_fixture(megatron_cpu):
    assert megatron_cpu.get_tensor_model_parallel_world_size() == 1
    assert megatron_cpu.model_parallel_is_initialized()
