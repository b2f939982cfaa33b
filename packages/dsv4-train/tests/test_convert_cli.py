"""``dsv4 convert`` and ``dsv4 train --init-from`` as users run them: exit codes, one-line errors naming the file,
never writing into a non-empty output or over the source, and a fresh process that creates its own parallel state.
The conversions themselves are tested at the model floor (hybrid-model's ``test_hf_*``)."""

import json
import shutil

import pytest
import torch

from dsv4_train.cli import main
from hybrid_model.hf import load_hf_checkpoint
from hybrid_model.hf.convert import export_hf_checkpoint
from hybrid_model.hf.io import read_tensors
from hybrid_model.model import build_model
from hybrid_model.presets import get_preset


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """The ``tiny`` preset (randomly initialised, MTP included) exported as an HF DeepSeek-V4 directory."""
    from dsv4_testkit.megatron_cpu import megatron_cpu_context

    path = tmp_path_factory.mktemp("hf") / "tiny"
    with megatron_cpu_context():
        torch.manual_seed(0)
        export_hf_checkpoint(build_model(get_preset("tiny")).eval(), path, max_shard_bytes=1 << 40)
    return path


def _truncate(f):
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])


def test_convert_cli_errors(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["convert", str(tmp_path / "empty"), str(tmp_path / "out")]) == 2
    assert "neither an HF checkpoint" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "missing"), str(tmp_path / "out")]) == 2


def test_load_and_convert_of_a_truncated_checkpoint_name_the_file(megatron_cpu, hf_dir, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(hf_dir, bad)
    _truncate(bad / "model.safetensors")
    with pytest.raises(ValueError, match=rf"^{bad / 'model.safetensors'}: not a readable safetensors file"):
        load_hf_checkpoint(bad)
    assert main(["convert", str(bad), str(tmp_path / "out")]) == 2
    assert f"dsv4 convert: error: {bad / 'model.safetensors'}: not a readable" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no partial output left


def test_convert_refuses_non_empty_output_and_overwrites_only_when_told(
    megatron_cpu, hf_dir, tmp_path, capsys
):
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text('{"keep": "me"}')
    assert main(["convert", str(hf_dir), str(out)]) == 2
    err = capsys.readouterr().err
    assert f"output directory {out} is not empty (holds ['config.json'])" in err and "--overwrite" in err
    assert json.loads((out / "config.json").read_text()) == {"keep": "me"}  # untouched
    assert main(["convert", str(hf_dir), str(out), "--overwrite"]) == 0
    assert (out / "metadata.json").is_file() and not (out / "config.json").exists()  # replaced as a whole
    back = tmp_path / "back"
    back.mkdir()  # an empty directory is fine
    assert main(["convert", str(out), str(back)]) == 0
    a, b = read_tensors(hf_dir), read_tensors(back)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert main(["convert", str(out), str(back)]) == 2  # now non-empty
    assert main(["convert", str(out), str(back), "--overwrite"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["back", "out"]  # no temporary directories left
    # the source is never an output
    assert main(["convert", str(out), str(out / "hf")]) == 2
    assert "overlap" in capsys.readouterr().err
    assert main(["convert", str(hf_dir), str(hf_dir), "--overwrite"]) == 2
    assert (hf_dir / "config.json").is_file()


def test_init_from_a_corrupt_checkpoint_names_it(megatron_cpu, hf_dir, tmp_path):
    """``dsv4 train --init-from`` of a checkpoint whose files are truncated: exit 2, one message naming it."""
    import os
    import subprocess
    import sys

    from hybrid_model.hf import convert

    mg = tmp_path / "mg"
    convert.convert_hf_to_megatron(hf_dir, mg)
    for f in mg.glob("*.distcp"):
        _truncate(f)
    (tmp_path / "a.txt").write_text("some text to train on " * 20)
    code = "import sys; from dsv4_train.cli import main; sys.exit(main(sys.argv[1:]))"
    argv = [
        "train",
        "--init-from",
        str(mg),
        "--data",
        str(tmp_path / "a.txt"),
        "--steps",
        "1",
        "--seq-len",
        "32",
    ]
    argv += [
        "--global-batch-size",
        "2",
        "--micro-batch-size",
        "2",
        "--out",
        str(tmp_path / "run"),
        "--no-progress",
    ]
    proc = subprocess.run(
        [sys.executable, "-c", code, *argv],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"dsv4 train: error: --init-from {mg}: cannot load the model weights (" in proc.stderr


def test_dsv4_convert_in_a_fresh_process(hf_dir, tmp_path):
    """The console command as users run it: no parallel state beforehand (created by the command itself)."""
    import subprocess
    import sys

    shutil.copytree(hf_dir, tmp_path / "hf")
    script = (
        "import sys; from dsv4_train.cli import main; "
        "sys.exit(main(['convert', sys.argv[1], sys.argv[2]]) or main(['convert', sys.argv[2], sys.argv[3]]))"
    )
    args = [str(tmp_path / d) for d in ("hf", "megatron", "back")]
    run = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    a, b = read_tensors(tmp_path / "hf"), read_tensors(tmp_path / "back")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_convert_of_a_train_run_reads_its_model_from_the_saved_run_config(megatron_cpu, tmp_path, capsys):
    """A ``dsv4 train`` checkpoint carries its run config (preset + overrides): no --preset needed; without it,
    the refusal says to pass --preset."""
    from dsv4_train.checkpoint import TRAIN_CONFIG_FILE
    from dsv4_train.config import TrainConfig
    from hybrid_model.hf.convert import MODEL_CONFIG_FILE, save_megatron_checkpoint

    torch.manual_seed(5)
    model = build_model(get_preset("tiny")).eval()
    ck = tmp_path / "run" / "checkpoints" / "iter_0000002"
    save_megatron_checkpoint(model, ck)
    (ck / MODEL_CONFIG_FILE).unlink()  # as dsv4 train writes it
    (ck.parent / "latest").write_text(ck.name)
    assert main(["convert", str(tmp_path / "run"), str(tmp_path / "no_config")]) == 2
    assert "--preset" in capsys.readouterr().err
    (ck / TRAIN_CONFIG_FILE).write_text(json.dumps(TrainConfig.from_flat(preset="tiny").to_dict()))
    assert main(["convert", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    back = load_hf_checkpoint(tmp_path / "hf")
    ids = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(1))
    assert torch.equal(back.compute_logits(ids), model.compute_logits(ids))


def test_a_wrongly_typed_config_json_is_one_line_and_rc_2_in_every_command(hf_dir, tmp_path, capsys):
    """``"num_hidden_layers": "4"`` (issue 29: a bare ``TypeError`` or a silent coercion) through ``dsv4 convert``,
    ``dsv4 generate --checkpoint`` and ``dsv4 train --init-from``: rc 2, one line naming the file, key and types."""
    bad = tmp_path / "bad"
    shutil.copytree(hf_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(dict(config, num_hidden_layers="4")))
    what = f"{bad / 'config.json'}: key 'num_hidden_layers' must be an integer, found a string ('4')"
    runs = {
        "convert": ["convert", str(bad), str(tmp_path / "out")],
        "generate": ["generate", "--checkpoint", str(bad), "--prompt-ids", "1,2", "--max-new-tokens", "1"],
        "train": ["train", "--init-from", str(bad), "--steps", "1", "--out", str(tmp_path / "run")],
    }
    for cmd, argv in runs.items():
        capsys.readouterr()
        assert main(argv) == 2, cmd
        err = capsys.readouterr().err
        assert err == f"dsv4 {cmd}: error: {what}\n", err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_init_from_an_hf_directory_gives_a_convert_command_that_works(hf_dir, tmp_path, capsys):
    """``dsv4 train --init-from HFDIR`` is refused at start (before the data are read) with the conversion to run;
    the suggested commands, run as given, train from the HF weights."""
    argv = ["train", "--seq-len", "32", "--global-batch-size", "2", "--micro-batch-size", "2", "--steps", "1"]
    argv += ["--no-progress"]
    assert main([*argv, "--init-from", str(hf_dir), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is a Hugging Face checkpoint directory" in err, err
    convert = err.split("convert it first with '")[1].split("'")[0].split()  # dsv4 convert HFDIR NEW_DIR
    assert convert == ["dsv4", "convert", str(hf_dir), "NEW_DIR"]
    new = tmp_path / "NEW_DIR"
    from dsv4_testkit.megatron_cpu import megatron_cpu_context

    with (
        megatron_cpu_context()
    ):  # in this process: the conversion's parallel state is torn down before the run
        assert main([*convert[1:3], str(new)]) == 0
    assert main([*argv, "--init-from", str(new), "--out", str(tmp_path / "run")]) == 0
    assert (tmp_path / "run" / "checkpoints" / "latest").is_file()
