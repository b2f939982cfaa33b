"""The converter's TP4 layout (``dsv4 convert HF OUT --tp 4``, issue 31) of a model TP4 splits: the ``tiny`` preset
with 4 output-projection groups (``o_groups=4``: ``tiny``'s 2 groups refuse ``--tp 4``,
``test_hf_megatron_tp.py``), written as an HF checkpoint from a random model. Each of the 4 rank files holds its
TP rank's slice of every TP-split tensor (the replicated tensors in rank 0's file), and the TP4 conversion reads
back (one process, megatron's resharding) as the TP1 conversion, bitwise."""

import pickle

import torch

from hybrid_model.hf import dist_format
from hybrid_model.hf.config_map import hf_config_from_model_config
from hybrid_model.hf.convert import convert_hf_to_megatron, load_megatron_checkpoint
from hybrid_model.hf.io import write_checkpoint
from hybrid_model.hf.megatron_layout import TargetLayout
from hybrid_model.hf.megatron_plan import meta_checkpoint_entries
from hybrid_model.hf.weights import official_state_dict
from hybrid_model.model import build_model
from hybrid_model.presets import get_preset

TP = 4


def test_tp4_conversion_holds_each_shard_in_its_writers_file(megatron_cpu, tmp_path):
    cfg = get_preset("tiny").replace(o_groups=TP)
    torch.manual_seed(0)
    plain = tmp_path / "plain"
    write_checkpoint(plain, official_state_dict(build_model(cfg)), hf_config_from_model_config(cfg))
    tensors, _, axes = meta_checkpoint_entries(cfg, TP)
    out = tmp_path / "tp4"
    rep = convert_hf_to_megatron(plain, out, layout=TargetLayout(tp=TP), workers=2)
    assert rep.files == TP
    md = pickle.loads((out / dist_format.METADATA_FILE).read_bytes())
    split_ranks = set()
    for idx, info in md.storage_data.items():
        rank = int(info.relative_path[2:].split("_")[0])
        a = axes.get(idx.fqn)
        if a is None:
            assert rank == 0, idx.fqn  # replicated over TP: written once, by TP rank 0
            continue
        assert rank == idx.offset[a] // (tensors[idx.fqn][0][a] // TP), (idx.fqn, idx.offset)
        split_ranks.add(rank)
    assert split_ranks == set(range(TP))
    ref_dir = tmp_path / "one"
    convert_hf_to_megatron(plain, ref_dir)
    got, ref = load_megatron_checkpoint(out).state_dict(), load_megatron_checkpoint(ref_dir).state_dict()
    assert sorted(got) == sorted(ref)
    assert [k for k in got if not k.endswith("_extra_state") and not torch.equal(got[k], ref[k])] == []
