"""Released-format checkpoints (FP8 + partial edge blocks, FP4 experts, MTP, tid2eid): import gives the logits of the
same weights dequantized by the reference; streamed dequantize -> quantize --like reproduces every stored tensor
byte for byte; an interrupted conversion resumes; bad checkpoints get one clear line per problem."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from released_case import QUANT, write_plain_and_released

from hybrid_model.hf.io import read_config, write_checkpoint
from hybrid_model.hf.quant import dequantize_fp4_ref, dequantize_fp8_ref
from hybrid_model.hf.released import check_inventory, scan
from hybrid_model.hf.safetensors_io import SafetensorsFile
from hybrid_model.hf.stream import dequantize_checkpoint, quantize_checkpoint


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return write_plain_and_released(tmp_path_factory.mktemp("released"))


def _all(path):
    stored, files = scan(path)
    return {n: files[s.file].read(n) for n, s in stored.items()}


def test_released_layout(megatron_cpu, dirs):
    _, rel = dirs
    cfg, quant, stored, pairs, _ = check_inventory(rel)
    assert quant == QUANT and cfg.num_nextn_predict_layers == 1
    kinds = {p.kind for p in pairs.values()}
    assert kinds == {"fp8", "fp4"}
    assert any(k.startswith("mtp.0.") and k in pairs for k in stored)  # MTP weights are quantized too
    assert stored["layers.0.ffn.gate.tid2eid"].dtype == torch.int64
    assert all(".experts." in n for n, p in pairs.items() if p.kind == "fp4")


def test_import_equals_reference_dequantization(megatron_cpu, dirs, tmp_path):
    from hybrid_model.hf import load_hf_checkpoint

    _, rel = dirs
    _, quant, _, pairs, _ = check_inventory(rel)
    t = _all(rel)
    ref = {}
    for name, v in t.items():
        if any(name == p.scale for p in pairs.values()):
            continue
        p = pairs.get(name)
        if p is None:
            ref[name] = v
        elif p.kind == "fp8":
            ref[name] = dequantize_fp8_ref(v, t[p.scale], quant.fp8_block)
        else:
            ref[name] = dequantize_fp4_ref(v, t[p.scale], quant.fp4_block)
    config = {k: v for k, v in read_config(rel).items() if k != "quantization_config"}
    write_checkpoint(tmp_path / "ref", ref, config)
    ids = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(0))
    a = load_hf_checkpoint(rel, mtp=True)
    b = load_hf_checkpoint(tmp_path / "ref", mtp=True)
    assert hasattr(a, "mtp")
    with torch.no_grad():
        assert torch.equal(a.compute_logits(ids), b.compute_logits(ids))


def test_round_trip_reproduces_the_released_bytes_and_resumes(megatron_cpu, dirs, tmp_path):
    _, rel = dirs
    lines = []

    def stop_after_two(line):
        lines.append(line)
        if len(lines) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        dequantize_checkpoint(rel, tmp_path / "bf16", progress=stop_after_two)
    assert (tmp_path / "bf16" / ".dsv4-convert-progress.json").is_file()
    rep = dequantize_checkpoint(rel, tmp_path / "bf16", progress=lines.append)
    assert rep.skipped == 2 and "GB/s" in lines[-1] and "ETA" in lines[-1]
    assert "quantization_config" not in read_config(tmp_path / "bf16")
    assert {v.dtype for k, v in _all(tmp_path / "bf16").items() if k.endswith("wq_a.weight")} == {
        torch.bfloat16
    }
    quantize_checkpoint(tmp_path / "bf16", tmp_path / "back", like=rel, workers=2)
    a, b = _all(rel), _all(tmp_path / "back")
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k
    assert (
        json.loads((rel / "model.safetensors.index.json").read_text())["weight_map"]
        == json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())["weight_map"]
    )


def _copy(rel, tmp_path):
    out = tmp_path / "bad"
    shutil.copytree(rel, out)
    return out


def test_missing_scale_and_misshapen_tensor_are_listed(megatron_cpu, dirs, tmp_path):
    _, rel = dirs
    bad = _copy(rel, tmp_path)
    stored, _ = scan(bad)
    victim = "layers.0.attn.wq_a.scale"
    f = stored[victim].file
    t = {n: v for n, v in SafetensorsFile(f).__dict__["entries"].items()}
    data = {n: SafetensorsFile(f).read(n) for n in t if n != victim}
    data["layers.0.attn_norm.weight"] = torch.ones(3) if "layers.0.attn_norm.weight" in data else None
    data = {k: v for k, v in data.items() if v is not None}
    from safetensors.torch import save_file

    save_file(data, str(f))
    idx = json.loads((bad / "model.safetensors.index.json").read_text())
    idx["weight_map"] = {k: v for k, v in idx["weight_map"].items() if k != victim}
    (bad / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(ValueError) as err:
        check_inventory(bad)
    msg = str(err.value)
    assert "missing scale: 'layers.0.attn.wq_a.weight'" in msg
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="missing scale"):
        dequantize_checkpoint(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing written before the check


def test_corrupt_shard_is_named(megatron_cpu, dirs, tmp_path):
    _, rel = dirs
    bad = _copy(rel, tmp_path)
    shard = sorted(bad.glob("*.safetensors"))[3]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 9])
    with pytest.raises(ValueError, match=f"{shard.name}.*truncated or corrupt"):
        check_inventory(bad)
    shard.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all" + data[24:])
    with pytest.raises(ValueError, match=f"{shard.name}.*corrupt header"):
        check_inventory(bad)
