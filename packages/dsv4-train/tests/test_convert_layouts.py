"""``dsv4 convert HF OUT --pp 2 [--vpp 2] | --ep 2 | --tp 2`` then ``dsv4 train --init-from OUT`` at that layout
(gloo, 2 ranks): every rank's weights equal those it loads from the one-process conversion (megatron resharding; at
``--tp 2`` a TP 1 checkpoint loaded into TP 2 shards), bitwise;
every tensor a rank writes in a save of that layout (its main replicas) is read from that rank's own file
``__{rank}_0.distcp``, and a rank reads no other stage's file (expert ranks read their stage's shared tensors
from its expert rank 0, the last stage its MTP embedding copy from the first stage, as in a checkpoint that layout
saved itself; TP: each TP rank's shards from its own file, the replicated tensors from TP rank 0's). The converted
checkpoints carry their manifest, so ``--init-from`` verified them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from convert_layout_runs import load_layouts
from warm_workers import run_warm

from dsv4_train.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

LAYOUTS = {
    "pp2": (dict(pp=2), ["--pp", "2"]),
    "ep2": (dict(ep=2), ["--ep", "2"]),
    "pp2xvpp2": (dict(pp=2, vpp=2), ["--pp", "2", "--vpp", "2"]),
    "tp2": (dict(tp=2), ["--tp", "2"]),
}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from dsv4_testkit.megatron_cpu import megatron_cpu_context
    from hybrid_model.hf.convert import export_hf_checkpoint
    from hybrid_model.model import build_model
    from hybrid_model.presets import get_preset

    path = tmp_path_factory.mktemp("hf") / "tiny"
    with megatron_cpu_context():
        torch.manual_seed(0)
        export_hf_checkpoint(build_model(get_preset("tiny")).eval(), path, max_shard_bytes=1 << 40)
    return path


def test_converted_layouts_load_their_own_files_and_equal_resharding(megatron_cpu, hf_dir, tmp_path, capsys):
    one = tmp_path / "one"
    assert main(["convert", str(hf_dir), str(one)]) == 0
    runs = []
    for name, (kw, flags) in LAYOUTS.items():
        out = tmp_path / name
        assert main(["convert", str(hf_dir), str(out), *flags]) == 0
        assert "dsv4_manifest.json" in {p.name for p in out.iterdir()}
        assert json.loads((out / "dsv4_model_config.json").read_text())["layout"]["pp"] == kw.get("pp", 1)
        runs.append((name, kw, str(out)))
    capsys.readouterr()
    results = run_warm(load_layouts, 2, runs, str(one), str(tmp_path / "runs"))
    for rank, res in enumerate(results):
        for name, r in res.items():
            own = f"__{rank}_0.distcp"
            assert r["rank"] == rank and r["params"] > 0
            assert r["differ"] == [], (name, rank, r["differ"][:5])
            assert r["main"] == [own], (name, rank, r["main"])  # what this rank would save: in its own file
            # EP: replicas of the non-expert tensors come from expert rank 0 (rank 0 here); PP: the last stage's
            # MTP embedding copy from the first stage (rank 0); TP: the tensors replicated over TP from TP rank 0:
            # nothing else is read from another rank's file
            assert set(r["every"]) <= {own, "__0_0.distcp"}, (name, rank, r["every"])
