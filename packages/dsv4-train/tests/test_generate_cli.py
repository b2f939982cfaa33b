"""``dsv4 generate`` as users run it: from a ``dsv4 train`` checkpoint (model from its saved run config, the run's
byte-level tokenizer for text prompts) and from an HF directory; the ids equal the Python API's on the same model;
bad inputs end with one message and exit 2."""

import json

import pytest
import torch

from dsv4_train.checkpoint import TRAIN_CONFIG_FILE
from dsv4_train.ckpt_integrity import checkpoint_files, file_entries, write_manifest
from dsv4_train.cli import main
from dsv4_train.config import TrainConfig
from hybrid_model.generation import generate
from hybrid_model.hf import load_megatron_checkpoint
from hybrid_model.hf.convert import MODEL_CONFIG_FILE, export_hf_checkpoint, save_megatron_checkpoint
from hybrid_model.model import build_model
from hybrid_model.presets import get_preset
from thd_packing import ByteTokenizer


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A dsv4 train-style run directory of the tiny preset with random weights (checkpoint + saved run config)."""
    from dsv4_testkit.megatron_cpu import megatron_cpu_context

    run = tmp_path_factory.mktemp("gen") / "run"
    ck = run / "checkpoints" / "iter_0000002"
    with megatron_cpu_context():
        torch.manual_seed(7)
        model = build_model(get_preset("tiny")).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.2)
        save_megatron_checkpoint(model, ck)
        export_hf_checkpoint(model, run.parent / "hf", max_shard_bytes=1 << 40)
    (ck / MODEL_CONFIG_FILE).unlink()  # as dsv4 train writes it: the model comes from the run config
    (ck / TRAIN_CONFIG_FILE).write_text(json.dumps(TrainConfig.from_flat().to_dict()))
    (ck.parent / "latest").write_text(ck.name)
    # its checksums, written last like dsv4 train's
    write_manifest(ck, file_entries(ck, checkpoint_files(ck)))
    return run


def _json(capsys, argv) -> dict:
    capsys.readouterr()
    assert main(["generate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_from_a_train_run_equals_the_api(megatron_cpu, run_dir, capsys):
    got = _json(
        capsys,
        ["--checkpoint", str(run_dir), "--prompt-ids", "5,6,7", "--prompt-ids", "9", "--max-new-tokens", "6"],
    )
    model = load_megatron_checkpoint(run_dir, model_config=get_preset("tiny"))
    assert got["ids"] == generate(model, [[5, 6, 7], [9]], 6)
    assert got["text"] == [ByteTokenizer().decode(ids) for ids in got["ids"]]
    text = _json(capsys, ["--checkpoint", str(run_dir), "--prompt", "def f(", "--max-new-tokens", "4"])
    assert text["ids"] == generate(model, [ByteTokenizer().encode("def f(")], 4)


def test_generate_from_an_hf_directory(megatron_cpu, run_dir, capsys):
    hf = run_dir.parent / "hf"
    got = _json(capsys, ["--checkpoint", str(hf), "--prompt-ids", "5,6,7", "--max-new-tokens", "3"])
    assert got["text"] is None and len(got["ids"][0]) == 3
    assert main(["generate", "--checkpoint", str(hf), "--prompt", "hi"]) == 2
    assert "has no tokenizer.json: pass --tokenizer FILE or --prompt-ids" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--prompt-ids", "1,2"], "is not a directory"),
        (["--prompt-ids", "a,b"], "must be comma-separated token ids"),
        ([], "give at least one --prompt"),
        (
            ["--prompt-ids", "1", "--max-new-tokens", "5000"],
            "exceeds the model's max_position_embeddings=4096",
        ),
        (["--prompt-ids", "1", "--temperature", "-1"], "temperature"),
    ],
)
def test_bad_inputs_exit_2_with_one_message(megatron_cpu, run_dir, capsys, argv, match):
    where = ["--checkpoint", str(run_dir / "missing" if "is not a directory" in match else run_dir)]
    assert main(["generate", *where, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dsv4 generate: error: ") and match in err, err
