"""Checkpoint files: every failed read of a safetensors file, an index or a config names the file and what to do;
``dsv4 convert`` refuses a non-empty output directory unless ``--overwrite``, never half-writes its output and never
writes over its source."""

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


def test_load_error_descriptions_are_one_short_line():
    from hybrid_model.hf.convert import MAX_ERROR_CHARS, describe_load_error

    long = RuntimeError("missing keys:\n" + "\n".join(f"decoder.layers.{i}.weight" for i in range(2000)))
    text = describe_load_error(long)
    assert "\n" not in text and text.startswith("RuntimeError: missing keys: decoder.layers.0.weight")
    assert len(text) < MAX_ERROR_CHARS + 40 and text.endswith("more characters)")
    assert describe_load_error(ValueError("short")) == "ValueError: short"
