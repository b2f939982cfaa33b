"""Checkpoint files: every failed read of a safetensors file, an index or a config names the file and what to do;
``dsv4 convert`` refuses a non-empty output directory unless ``--overwrite``, never half-writes its output and never
writes over its source."""

import json
import shutil

import pytest
import torch
import transformers

from hybrid_model.hf.io import INDEX, read_config, read_tensors, write_checkpoint


def _tiny_hf(path):
    """A small random transformers DeepSeek-V4 checkpoint directory (save_pretrained)."""
    cfg = transformers.DeepseekV4Config(
        vocab_size=64,
        hidden_size=32,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        head_dim=16,
        q_lora_rank=16,
        partial_rotary_factor=0.5,
        layer_types=["sliding_attention", "compressed_sparse_attention"],
        mlp_layer_types=["hash_moe", "moe"],
        n_routed_experts=8,
        num_experts_per_tok=2,
        sliding_window=8,
        o_groups=2,
        o_lora_rank=8,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=4,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    model = transformers.DeepseekV4ForCausalLM(cfg)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):  # distinct experts per token (HF leaves a zero placeholder)
                b.copy_(torch.stack([torch.randperm(8)[: b.shape[1]] for _ in range(b.shape[0])]))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return _tiny_hf(tmp_path_factory.mktemp("hf") / "tiny")


def _truncate(f):
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])


def test_truncated_and_corrupt_safetensors_name_the_file(tmp_path):
    ck = tmp_path / "ck"
    write_checkpoint(ck, {"a": torch.ones(64, 64), "b": torch.zeros(64, 64)}, {"x": 1}, max_shard_bytes=16384)
    shard = ck / "model-00001-of-00002.safetensors"
    _truncate(shard)
    with pytest.raises(ValueError) as err:
        read_tensors(ck)
    assert str(err.value).startswith(f"{shard}: not a readable safetensors file (")
    assert "truncated or corrupt" in str(err.value) and "re-download or re-export" in str(err.value)
    shard.write_bytes(b"garbage" * 10)
    with pytest.raises(ValueError, match=rf"^{shard}: not a readable safetensors file"):
        read_tensors(ck)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("{not json", r"is not valid JSON .*the safetensors index is truncated or corrupt"),
        ('{"metadata": {}}', "has no 'weight_map' object"),
        ('{"weight_map": {"a": "gone.safetensors"}}', r"lists missing shard files .*gone\.safetensors"),
    ],
)
def test_bad_index_names_the_file(tmp_path, content, match):
    ck = tmp_path / "ck"
    write_checkpoint(ck, {"a": torch.ones(4)}, {"x": 1})
    (ck / INDEX).write_text(content)
    with pytest.raises(ValueError, match=match) as err:
        read_tensors(ck)
    assert str(err.value).startswith(str(ck / INDEX))


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ('{"hidden_size": 3', r"is not valid JSON .*the model config is truncated or corrupt: re-download"),
        ("[1, 2]", "holds a JSON list, not an object"),
        (b"\xff\xfe{}", "is not UTF-8 text"),
    ],
)
def test_bad_config_names_the_file(tmp_path, content, match):
    (tmp_path / "ck").mkdir()
    f = tmp_path / "ck" / "config.json"
    f.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ValueError, match=match) as err:
        read_config(tmp_path / "ck")
    assert str(f) in str(err.value)


def test_write_checkpoint_never_writes_into_a_non_empty_directory(tmp_path):
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "config.json").write_text("mine")
    with pytest.raises(ValueError, match=r"already holds files \['config.json'\]"):
        write_checkpoint(tmp_path / "ck", {"a": torch.ones(2)}, {"x": 1})
    assert (tmp_path / "ck" / "config.json").read_text() == "mine"


def test_load_and_convert_of_a_truncated_checkpoint_name_the_file(megatron_cpu, hf_dir, tmp_path, capsys):
    from hybrid_model.cli import main
    from hybrid_model.hf import load_hf_checkpoint

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
    from hybrid_model.cli import main

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


def test_a_failed_write_leaves_no_output(megatron_cpu, hf_dir, tmp_path, monkeypatch):
    """An error in the middle of writing (disk full, a kill) leaves the output directory as it was."""
    from hybrid_model.hf import convert

    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("previous output")
    mg = tmp_path / "mg"
    convert.convert_hf_to_megatron(hf_dir, mg)

    def fail_after_one_file(path, tensors, config, **kw):
        (path / "model-00001-of-00002.safetensors").write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(convert, "write_checkpoint", fail_after_one_file)
    with pytest.raises(OSError, match="No space left"):
        convert.convert_megatron_to_hf(mg, out, overwrite=True)
    assert [p.name for p in out.iterdir()] == ["old.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mg", "out"]
    with pytest.raises(OSError):
        convert.convert_megatron_to_hf(mg, tmp_path / "new")
    assert not (tmp_path / "new").exists()


def test_corrupt_megatron_checkpoint_names_the_directory(megatron_cpu, hf_dir, tmp_path):
    from hybrid_model.hf import convert

    mg = tmp_path / "mg"
    convert.convert_hf_to_megatron(hf_dir, mg)
    for f in mg.glob("*.distcp"):
        _truncate(f)
    with pytest.raises(ValueError, match=rf"^{mg}: cannot load the megatron dist checkpoint"):
        convert.convert_megatron_to_hf(mg, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    (mg / convert.MODEL_CONFIG_FILE).write_text("{trunc")
    with pytest.raises(
        ValueError, match=rf"{mg / convert.MODEL_CONFIG_FILE} is unreadable or not valid JSON"
    ):
        convert.load_megatron_checkpoint(mg)


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
    code = "import sys; from hybrid_model.cli import main; sys.exit(main(sys.argv[1:]))"
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
