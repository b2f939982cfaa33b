"""``dsv4 convert`` / ``dsv4 inspect --checkpoint`` with the released FP8 / FP4 format: export to it, inspect it,
stream it back to bf16, convert it to a megatron checkpoint; ``--tp > 1`` refused in one line."""

import pytest
import torch

from dsv4_train.cli import main
from hybrid_model.hf.convert import export_hf_checkpoint
from hybrid_model.model import build_model
from hybrid_model.presets import get_preset


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
    assert main(["convert", str(rel), str(tmp_path / "x"), "--tp", "2"]) == 2
    assert "--tp 2: tensor-parallel size 2" in capsys.readouterr().err
