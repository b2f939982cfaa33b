"""The converter's tensor-parallel split (:mod:`hybrid_model.hf.megatron_tp`): the partition axes read off the TP = 1
meta model against the real TP = 2 model are checked in ``test_tp_checkpoint_sharding.py`` (one gloo run builds it
for both tests: ``test_the_converters_partition_axes_are_the_tp2_models``); here the cut pieces concatenate back to the tensor; a ``--tp 2 --ep 2`` conversion puts each TP shard into
its writer's file and reads back (one process, megatron's resharding) as the same model; ``--tp`` values the model
cannot split are refused in one line naming the size and the values that fit."""

import pickle
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from released_case import write_plain_and_released

from hybrid_model.hf import dist_format
from hybrid_model.hf.convert import convert_hf_to_megatron, load_megatron_checkpoint
from hybrid_model.hf.megatron_layout import TargetLayout, owned_boxes
from hybrid_model.hf.megatron_plan import Piece, meta_checkpoint_entries
from hybrid_model.hf.megatron_tp import tp_cuts
from hybrid_model.presets import get_preset

TP = 2


def test_cut_pieces_concatenate_to_the_tensor():
    full = torch.arange(8 * 6 * 4, dtype=torch.float32).reshape(8, 6, 4)
    for axis in (0, 1):
        for tp in (1, 2):
            # a whole tensor and a piece [2:8) along the axis that straddles the TP shard edge
            for lo in (0, 2):
                placed_shape = tuple(n - lo if i == axis else n for i, n in enumerate(full.shape))
                placed = tuple(lo if i == axis else 0 for i in range(3))
                cuts = tp_cuts(placed, placed_shape, tuple(full.shape), axis, tp)
                assert [t for t, _, _ in cuts] == list(range((lo * tp) // full.shape[axis], tp))
                src = full.narrow(axis, lo, placed_shape[axis]).flatten()  # the source as stored (any shape)
                parts = [
                    Piece("w", "k", o, s, torch.float32, 0, placed, placed_shape).cut(src) for _, o, s in cuts
                ]
                for (t, o, s), part in zip(cuts, parts):
                    per = full.shape[axis] // tp
                    assert t * per <= o[axis] and o[axis] + s[axis] <= (t + 1) * per  # inside rank t's shard
                    assert torch.equal(part, full[tuple(slice(a, a + n) for a, n in zip(o, s))])
                assert torch.equal(torch.cat(parts, axis), full.narrow(axis, lo, placed_shape[axis]))
    assert tp_cuts((0, 0), (4, 2), (4, 2), None, 2) == [(0, (0, 0), (4, 2))]


def test_ranks_of_a_tp_pp_ep_layout():
    """TP2 x PP2 x EP2: stage 1 is ranks 4..7; a dense shard of TP rank t goes to rank 4 + t, expert rank e's
    experts to rank 4 + e, replicated tensors to rank 4."""
    layout = TargetLayout(tp=2, pp=2, ep=2)
    assert layout.world == 8 and layout.describe() == "TP2 x PP2 x EP2 (8 rank(s))"
    seg = [1] * 12
    boxes = owned_boxes("decoder.layers.3.x.weight", (0, 0), (8, 4), (8, 4), layout, seg, 0)
    assert [(b.offset, b.shape, b.rank) for b in boxes] == [((0, 0), (4, 4), 4), ((4, 0), (4, 4), 5)]
    bank = "decoder.layers.3.mlp.experts.down_proj"
    assert [b.rank for b in owned_boxes(bank, (5, 0, 0), (1, 4, 2), (8, 4, 2), layout, seg)] == [5]
    assert [b.rank for b in owned_boxes("decoder.layers.3.n.weight", (0,), (4,), (4,), layout, seg)] == [4]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return write_plain_and_released(tmp_path_factory.mktemp("tp"))


def test_tp2_ep2_conversion_holds_each_shard_in_its_writers_file(megatron_cpu, dirs, tmp_path):
    tensors, _, axes = meta_checkpoint_entries(get_preset("tiny"), TP)
    _, rel = dirs
    out = tmp_path / "tp2"
    rep = convert_hf_to_megatron(rel, out, layout=TargetLayout(tp=TP, ep=2), workers=2)
    assert rep.files == 4
    md = pickle.loads((out / dist_format.METADATA_FILE).read_bytes())
    split = 0
    for idx, info in md.storage_data.items():
        rank = int(info.relative_path[2:].split("_")[0])
        if idx.fqn.endswith(("experts.gate_up_proj", "experts.down_proj")):
            assert rank == idx.offset[0] // 4, (idx.fqn, idx.offset)  # expert rank e = global rank e
        elif idx.fqn in axes and axes[idx.fqn] is not None:
            a = axes[idx.fqn]
            assert rank == idx.offset[a] // (tensors[idx.fqn][0][a] // TP), (idx.fqn, idx.offset)
            split += 1
        else:
            assert rank == 0, idx.fqn
    assert split > 0
    ref_dir = tmp_path / "one"
    convert_hf_to_megatron(rel, ref_dir)
    got, ref = load_megatron_checkpoint(out).state_dict(), load_megatron_checkpoint(ref_dir).state_dict()
    assert sorted(got) == sorted(ref)
    for k in got:
        if not k.endswith("_extra_state"):
            assert torch.equal(got[k], ref[k]), k


@pytest.mark.parametrize(
    ("tp", "message"),
    [
        (3, r"--tp 3: tensor-parallel size 3 must divide o_groups=2 .*; --tp 1, 2 fit this model"),
        (4, r"--tp 4: tensor-parallel size 4 must divide o_groups=2 .*; --tp 1, 2 fit this model"),
    ],
    ids=["tp3", "tp4"],
)
def test_a_tp_the_model_cannot_split_is_refused_before_any_work(megatron_cpu, dirs, tmp_path, tp, message):
    plain, _ = dirs
    with pytest.raises(ValueError, match=message):
        convert_hf_to_megatron(plain, tmp_path / "mg", layout=TargetLayout(tp=tp))
    assert list(tmp_path.iterdir()) == []


def test_a_split_size_tp_does_not_divide_is_named(megatron_cpu):
    with pytest.raises(
        ValueError,
        match=r"^--tp 2: embedding\.word_embeddings\.weight has 513 entries along its tensor-parallel axis 0 "
        r"\(shape \(513, 64\)\), not divisible by 2; --tp 1 fits this model$",
    ):
        meta_checkpoint_entries(get_preset("tiny").replace(vocab_size=513), 2)
