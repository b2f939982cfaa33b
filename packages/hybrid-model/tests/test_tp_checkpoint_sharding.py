"""Every TP-split parameter of the model is checkpointed as its TP shard, every other one as one replicated tensor.

The tiny preset built at TP = 2 (gloo) with every pattern symbol that runs under tensor parallelism on this machine
(the symbol records of :mod:`hybrid_model.mixers`: DSv4 attention ``C H W`` (its head split, dsv4-attention's
``HEAD_SPLIT``), megatron's attention ``*`` (one attention family per model, so a second pattern), the MLP ``-``,
DSv4 MoE ``E``, mHC, one MTP depth, the embedding and output layer). For each parameter, the ShardedTensor(s) of
``model.sharded_state_dict()`` that hold it (matched by identity, as megatron's optimizer matches them):

* ``tensor_model_parallel=True``: global shape = local shape x TP along ``partition_dim``, global offset there =
  TP rank x local size (0 elsewhere), and every TP rank writes its shard (replica id 0 at DP rank 0);
* every other parameter: the full tensor (global shape = local shape, offset 0) replicated over TP: the ranks
  declare the same entry and exactly one of them writes it.

The converter's TP split (``dsv4 convert --tp N``, :mod:`hybrid_model.hf.megatron_tp`) reads each key's partition
axis off the TP = 1 meta model; the same run builds the preset's own model (the HF checkpoints' pattern) at TP = 2,
and every checkpoint entry each TP rank declares must be the box the converter writes for it.

Before dsv4-attention 0.7.2 the head-split parameters were declared replicated (TP rank 0's heads saved, loaded
into every rank). Symbols whose layer needs packages this machine lacks (``M``: transformer-engine, mamba-ssm,
causal-conv1d and a GPU) are built where those are installed; the test lists which symbols it covered.
"""

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from tp_sharding_workers import tp_sharded_entries

from dsv4_testkit import run_distributed
from hybrid_model.hf.megatron_plan import meta_checkpoint_entries
from hybrid_model.hf.megatron_tp import tp_cuts
from hybrid_model.mixers.record import Layout
from hybrid_model.mixers.registry import REGISTRY
from hybrid_model.presets import get_preset

PATTERNS = ["WCH-E/WE", "*E-E/*E"]
TP = 2


def _runnable_tp_symbols() -> set[str]:
    return {
        s
        for s, r in REGISTRY.items()
        if r.refusal(Layout.TP) is None and r.refusal(Layout.CPU) is None and not r.missing_packages()
    }


def _check(rank_entries: list[dict]) -> int:
    """Assert the invariant over the TP ranks' entries of one pattern; returns the number of TP-split params."""
    split = 0
    by_rank = []
    for entries in rank_entries:
        params, holders = entries["params"], {}
        for key, data_id, part, local, global_, offset, replica, pre in entries["sharded"]:
            if data_id in params:
                holders.setdefault(data_id, []).append(
                    (key, part, local, global_[pre:], offset[pre:], replica)
                )
        missing = [params[i][0] for i in params if i not in holders]
        assert missing == [], f"parameters without a ShardedTensor: {missing}"
        by_rank.append({params[i][0]: (params[i], holders[i]) for i in params})
    names = set(by_rank[0])
    assert all(set(r) == names for r in by_rank)
    for name in sorted(names):
        for rank, entries in enumerate(by_rank):
            (_, shape, tp_split, dim), held = entries[name]
            for key, part, local, global_, offset, replica in held:
                assert part or local == shape, (name, key, local, shape)  # a part: one piece of a gated fc1
                if tp_split:
                    want = tuple(n * TP if i == dim else n for i, n in enumerate(shape))
                    assert global_ == want, f"{key}: global {global_}, want {want} (TP-split along {dim})"
                    if not part:
                        assert offset == tuple(rank * n if i == dim else 0 for i, n in enumerate(local)), (
                            key,
                            offset,
                        )
                    assert replica == (0, 0, 0), (key, replica)  # every TP rank writes its own shard
                else:
                    assert global_ == shape and offset == (0,) * len(shape), (key, global_, offset)
        (_, _, tp_split, _), _ = by_rank[0][name]
        split += tp_split
        if (
            tp_split
        ):  # the ranks' pieces tile the global tensor: disjoint offsets, volumes summing to the whole
            pieces = [(h[4], h[2]) for r in by_rank for h in r[name][1]]
            assert len({o for o, _ in pieces}) == len(pieces), (name, pieces)
            total = sum(math.prod(n) for _, n in pieces)
            assert total == math.prod(by_rank[0][name][1][0][3]), (name, pieces)
        if not tp_split:  # one writer among the TP ranks, the others replicas of the same key
            writers = [r for r in by_rank if any(h[5] == (0, 0, 0) for h in r[name][1])]
            assert len(writers) == 1, (name, [r[name][1] for r in by_rank])
            assert {h[0] for h in by_rank[0][name][1]} == {h[0] for h in by_rank[1][name][1]}, name
    return split


@pytest.fixture(scope="module")
def tp2_ranks():
    """Each TP rank's entries of the patterns and of the preset's own model (``None``), built at TP = 2 (gloo)."""
    return run_distributed(tp_sharded_entries, TP, [*PATTERNS, None], timeout=600)


@pytest.mark.distributed
def test_tp_split_parameters_are_checkpointed_as_tp_shards(tp2_ranks):
    covered = {s for p in PATTERNS for s in p if s in REGISTRY}
    assert covered >= _runnable_tp_symbols(), _runnable_tp_symbols() - covered
    ranks = tp2_ranks
    assert [r[PATTERNS[0]]["tp_rank"] for r in ranks] == [0, 1]
    for pattern in PATTERNS:
        split = _check([r[pattern] for r in ranks])
        assert split > 0, pattern  # the embedding / output layer / linears of each pattern are TP-split


@pytest.mark.distributed
def test_the_converters_partition_axes_are_the_tp2_models(megatron_cpu, tp2_ranks):
    """``dsv4 convert --tp 2``'s split of every key (its axis from the TP = 1 meta model) against the real TP = 2
    model: the parameters' own ``tensor_model_parallel`` / ``partition_dim``, and each rank's declared box (its
    shard, or the whole replicated tensor written by TP rank 0 only)."""
    tensors, _, axes = meta_checkpoint_entries(get_preset("tiny"), TP)
    assert {a for a in axes.values()} == {None, 0, 1}
    ranks = [r[None] for r in tp2_ranks]
    for tp_rank, entries in enumerate(ranks):
        params = entries["params"]
        declared = {}
        for key, data_id, part, local, global_, offset, replica, pre in entries["sharded"]:
            assert not part and pre == 0, key  # DSv4 holds no factories / prepended axes at PP = 1
            declared[key] = (local, global_, offset, replica)
            if data_id in params:  # the trainer's parameter: its own TP attributes
                _, _, split, dim = params[data_id]
                assert axes[key] == (dim if split else None), (key, axes[key], split, dim)
        assert set(declared) == set(tensors)
        for key, (local, global_, offset, replica) in declared.items():
            shape = tensors[key][0]
            assert global_ == shape, key  # the TP = 1 keys and global shapes
            cuts = {t: (o, s) for t, o, s in tp_cuts((0,) * len(shape), shape, shape, axes[key], TP)}
            if axes[key] is None:  # replicated: written by TP rank 0 (the converter's dense_rank(p, 0))
                assert (offset, local) == cuts[0], key
                assert (all(r == 0 for r in replica)) == (tp_rank == 0), (key, replica)
            else:  # this TP rank's own shard, written by it
                assert (offset, local) == cuts[tp_rank] and all(r == 0 for r in replica), key
