"""``hybrid_model.dist_load.load_across_tp``: an ``_extra_state`` entry the checkpoint lacks loads as ``None``; any
other entry the checkpoint lacks is an error, not a silently skipped tensor. (A TP2 ``dsv4 train`` checkpoint read
at TP1 end to end: dsv4-train's ``tests/test_train_tp_resume.py``.)"""

import pytest
import torch
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

from hybrid_model.dist_load import MissingCheckpointEntries, load_across_tp
from hybrid_model.hf.convert import save_megatron_checkpoint
from hybrid_model.model import build_model
from hybrid_model.presets import get_preset


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from dsv4_testkit.megatron_cpu import megatron_cpu_context

    path = tmp_path_factory.mktemp("dist-load") / "ckpt"
    with megatron_cpu_context():
        torch.manual_seed(3)
        model = build_model(get_preset("tiny")).eval()
        save_megatron_checkpoint(model, path)
    return model, path


def test_absent_extra_state_loads_as_none(megatron_cpu, saved):
    model, path = saved
    template = dict(model.sharded_state_dict())
    name = "decoder.layers.0.inner_layer.self_attention.extra_linear._extra_state"
    template[name] = ShardedObject(name, None, (1,), (0,), replica_id=0)
    state = load_across_tp({"model": template}, str(path))["model"]
    assert state[name] is None
    weights = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    assert weights and all(torch.equal(state[k], v) for k, v in weights.items())


def test_any_other_absent_entry_is_refused(megatron_cpu, saved):
    model, path = saved
    template = dict(model.sharded_state_dict())
    name = "decoder.layers.0.inner_layer.self_attention.extra_linear.weight"
    template[name] = ShardedTensor.from_rank_offsets(name, torch.zeros(4), replica_id=0)
    with pytest.raises(MissingCheckpointEntries, match=r"the checkpoint holds no .*extra_linear\.weight"):
        load_across_tp({"model": template}, str(path))
