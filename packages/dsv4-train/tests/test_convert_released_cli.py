"""``dsv4 convert`` / ``dsv4 inspect --checkpoint`` with the released FP8 / FP4 format: export to it, inspect it,
stream it back to bf16, convert it to a megatron checkpoint, at TP 1 and ``--tp 2`` (a ``--tp`` the model cannot
split refused in one line); ``dsv4 train --init-from`` the ``--tp 2`` conversion at ``--tp 2`` (torchrun, gloo)
starts like one process from the TP 1 conversion (the trainer loading a conversion at another TP size, both ways,
is ``test_convert_layouts.py``'s ``tp2`` layout: bitwise the TP 2 trainer's weights from either); one process
``dsv4 train --init-from`` the ``--tp 2`` conversion trains bit for bit as from the TP 1 conversion.

Bound (fp32): the TP 2 step differs from one process only in the summation order of the row-parallel products, the
vocab-parallel softmax statistics and the replicated gradients' TP all-reduce (``tests/test_train_tensor_parallel.py``
states the bound): the losses and the grad norm within ``2e-5`` relative, as there."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from cli_runs import torchrun, train_in_workers, train_metrics
from warm_workers import run_warm

from dsv4_train.cli import main
from hybrid_model.hf.convert import export_hf_checkpoint
from hybrid_model.model import build_model
from hybrid_model.presets import get_preset

_TRAIN = [
    "--preset", "tiny", "--seed", "11", "--seq-len", "32", "--global-batch-size", "2", "--micro-batch-size", "1",
    "--steps", "1", "--no-progress", "--no-save-final",
]  # fmt: skip


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from dsv4_testkit.megatron_cpu import megatron_cpu_context

    path = tmp_path_factory.mktemp("hf") / "tiny"
    with megatron_cpu_context():
        torch.manual_seed(0)
        export_hf_checkpoint(build_model(get_preset("tiny")).eval(), path, max_shard_bytes=1 << 40)
    return path


def test_released_format_through_the_cli(megatron_cpu, hf_dir, tmp_path, capsys):
    rel, bf16, meg = tmp_path / "rel", tmp_path / "bf16", tmp_path / "meg"
    assert main(["convert", str(hf_dir), str(rel), "--to", "released", "--max-shard-gb", "0.0002"]) == 0
    err = capsys.readouterr().err
    assert "GB/s" in err and "ETA" in err
    assert main(["inspect", "--checkpoint", str(rel)]) == 0
    out = capsys.readouterr().out
    assert "released (FP8 block-scaled + FP4 experts)" in out and "MTP depths [0]" in out
    assert "hash tables 2" in out and "'fp4':" in out
    assert main(["convert", str(rel), str(bf16), "--to", "hf-bf16"]) == 0
    assert main(["inspect", "--checkpoint", str(bf16), "--json"]) == 0
    assert '"quantization": null' in capsys.readouterr().out
    assert main(["convert", str(rel), str(meg)]) == 0
    assert (meg / "metadata.json").is_file()
    assert main(["convert", str(rel), str(tmp_path / "x"), "--tp", "3"]) == 2
    err = capsys.readouterr().err
    assert (
        "--tp 3: tensor-parallel size 3 must divide o_groups=2" in err and "--tp 1, 2 fit this model" in err
    )
    assert not (tmp_path / "x").exists()
    meg2 = tmp_path / "meg_tp2"
    assert main(["convert", str(rel), str(meg2), "--tp", "2"]) == 0
    cap = capsys.readouterr()
    assert "TP2 x PP1 x EP1 (2 rank(s))" in cap.out
    assert "layout TP2 x PP1 x EP1 (2 rank(s)): 2 of 2 rank files to write" in cap.err
    args = [*_TRAIN, "--no-bf16"]
    # both one-process runs one after the other in one process (cli_runs.train_in_workers: the CLI's main, each run
    # building and destroying its own megatron state, one thread as under torchrun); the TP 2 run is a torchrun launch
    single = [
        ("one", [*args, "--init-from", str(meg), "--out", str(tmp_path / "one")]),
        ("one_tp2", [*args, "--init-from", str(meg2), "--out", str(tmp_path / "one_tp2")]),
    ]
    (rows,) = run_warm(train_in_workers, 1, single, timeout=900)
    one, one_from_tp2 = rows["one"][0], rows["one_tp2"][0]
    tp2 = train_metrics(torchrun(2), tmp_path / "tp2", *args, "--tp", "2", "--init-from", str(meg2))[0]
    # the --tp 2 conversion loaded by one process (megatron reassembles the TP shards): the same weights as the TP 1
    # conversion, so the same step bit for bit (two runs of this test on this machine)
    for key in ("lm_loss", "mtp_loss", "grad_norm"):
        assert one_from_tp2[key] == one[key], (key, one_from_tp2[key], one[key])
    assert one["step"] == tp2["step"] == 1
    for key in ("lm_loss", "mtp_loss", "grad_norm"):
        assert tp2[key] == pytest.approx(one[key], rel=2e-5), (key, tp2[key], one[key])
