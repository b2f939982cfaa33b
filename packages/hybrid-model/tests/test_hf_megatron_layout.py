"""Streamed HF / released -> megatron conversion into a target PP / VPP / EP layout: the checkpoint holds the model
that the whole-model conversion holds (plain and released FP8 / FP4 sources, bitwise), at every layout (read back
in one process: megatron's resharding), each rank's file holds exactly its stage's tensors and its experts, an
interrupted conversion resumes (or is refused for another command), bad layouts get one clear line.

The multi-rank loads (``dsv4 train --init-from`` at PP2 / EP2 / PP2 x VPP2 with gloo, reading only their own
files) are in dsv4-train's ``test_convert_layouts.py``; the memory bound in :mod:`megatron_memory_case`."""

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from released_case import write_plain_and_released

from hybrid_model.hf import dist_format, stream_megatron
from hybrid_model.hf.convert import convert_hf_to_megatron, load_megatron_checkpoint
from hybrid_model.hf.loader import load_hf_checkpoint
from hybrid_model.hf.megatron_layout import TargetLayout, layer_segments


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return write_plain_and_released(tmp_path_factory.mktemp("layout"))


@pytest.fixture(scope="module")
def references(dirs):
    """The whole-model conversion's model of each source (fp32, one process) and some token ids."""
    from dsv4_testkit.megatron_cpu import megatron_cpu_context

    with megatron_cpu_context():
        refs = {name: load_hf_checkpoint(path) for name, path in zip(("plain", "released"), dirs)}
    return refs, torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(3))


def _same_model(got, ref) -> None:
    a, b = got.state_dict(), ref.state_dict()
    assert sorted(a) == sorted(b)
    for k in a:
        if not k.endswith("_extra_state"):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("which", ["plain", "released"])
def test_streamed_checkpoint_holds_the_whole_model_conversion(
    megatron_cpu, dirs, references, tmp_path, which
):
    src = dict(zip(("plain", "released"), dirs))[which]
    refs, ids = references
    rep = convert_hf_to_megatron(src, tmp_path / "mg")
    assert rep.files == 1 and rep.bytes_read > 0
    got = load_megatron_checkpoint(tmp_path / "mg")
    _same_model(got, refs[which])
    assert torch.equal(got.compute_logits(ids), refs[which].compute_logits(ids))
    meta = json.loads((tmp_path / "mg" / stream_megatron.MODEL_CONFIG_FILE).read_text())
    assert meta["layout"] == {"pp": 1, "vpp": 1, "ep": 1, "tp": 1} and "hf_config_extra" in meta
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mg"]  # no partial directory left


def _files_by_key(path: Path) -> dict:
    md = pickle.loads((path / dist_format.METADATA_FILE).read_bytes())
    out: dict = {}
    for idx, info in md.storage_data.items():
        out.setdefault(idx.fqn, []).append(
            (tuple(idx.offset) if idx.offset is not None else None, info.relative_path)
        )
    return out


def test_each_rank_file_holds_its_stage_and_its_experts(megatron_cpu, dirs, references, tmp_path):
    """PP2 x VPP2 x EP2 (6 blocks in 4 segments of 2, 2, 1, 1 blocks): read back in one process it is the same
    model; rank p·2 + e's file holds the layers of its segments (chunk v of rank p: segment 2v + p) and experts
    4e..4e+3 of their MoE layers; embedding on rank 0, head, HyperHead and MTP on the last segment's rank."""
    _, rel = dirs
    refs, _ = references
    layout = TargetLayout(pp=2, vpp=2, ep=2)
    out = tmp_path / "mg"
    rep = convert_hf_to_megatron(rel, out, layout=layout, workers=2)
    assert rep.files == 4
    _same_model(load_megatron_checkpoint(out), refs["released"])
    segments = layer_segments(layout.stage_model_config(refs["released"].model_config))
    assert segments == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 3, 3]
    seen = set()
    for key, rows in _files_by_key(out).items():
        for offset, file in rows:
            rank = int(file[2:].split("_")[0])
            pp_rank, ep_rank = divmod(rank, 2)
            seen.add(rank)
            if key.startswith("decoder.layers."):
                assert pp_rank == segments[int(key.split(".")[2])] % 2, key
            elif key.startswith(("mtp.", "output_layer.", "decoder.final_norm", "decoder.hyper_head")):
                assert pp_rank == 1, key  # segment 3 = chunk 1 of rank 1
            else:
                assert key.startswith(("embedding.", "common_state")) and rank == 0, key
            if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
                assert ep_rank == offset[0] // 4, (key, offset)
            else:
                assert ep_rank == 0, key
    assert seen == {0, 1, 2, 3}


@pytest.mark.parametrize(
    "layout",
    [TargetLayout(pp=2), TargetLayout(ep=2), TargetLayout(tp=2, pp=2)],
    ids=["pp2", "ep2", "tp2xpp2"],
)
def test_a_layout_checkpoint_reshards_to_one_process(megatron_cpu, dirs, references, tmp_path, layout):
    plain, _ = dirs
    refs, ids = references
    convert_hf_to_megatron(plain, tmp_path / "mg", layout=layout)
    got = load_megatron_checkpoint(tmp_path / "mg")
    _same_model(got, refs["plain"])
    assert torch.equal(got.compute_logits(ids), refs["plain"].compute_logits(ids))


def test_an_interrupted_conversion_resumes_or_is_refused(
    megatron_cpu, dirs, references, tmp_path, monkeypatch
):
    plain, _ = dirs
    out = tmp_path / "mg"
    layout = TargetLayout(ep=2)
    calls = {"n": 0}
    real = dist_format.DistcpWriter.add_tensor

    def interrupted(self, *args):
        calls["n"] += 1
        if self.path.name == dist_format.distcp_name(1) and calls["n"] > 5:
            raise KeyboardInterrupt
        return real(self, *args)

    monkeypatch.setattr(dist_format.DistcpWriter, "add_tensor", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert_hf_to_megatron(plain, out, layout=layout)
    part = stream_megatron.partial_dir(out)
    assert not out.exists() and part.is_dir()  # nothing loadable was published
    finished = part / dist_format.distcp_name(0)
    stamp = finished.stat().st_mtime_ns
    monkeypatch.setattr(dist_format.DistcpWriter, "add_tensor", real)
    with pytest.raises(
        ValueError, match=r"holds an interrupted conversion into .* with another source, layout"
    ):
        convert_hf_to_megatron(plain, out, layout=TargetLayout(pp=2))
    rep = convert_hf_to_megatron(plain, out, layout=layout)  # the same command: resumes after rank 0's file
    assert rep.skipped == 1 and not part.exists()
    assert (out / dist_format.distcp_name(0)).stat().st_mtime_ns == stamp
    _same_model(load_megatron_checkpoint(out), references[0]["plain"])
    with pytest.raises(
        ValueError, match=r"is not empty \(holds .*\); choose a new or empty directory, or pass --overwrite"
    ):
        convert_hf_to_megatron(plain, out)
    assert convert_hf_to_megatron(plain, out, overwrite=True).skipped == 0


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        (dict(ep=3), r"--ep 3: the model has 8 routed experts per MoE layer, not divisible by --ep 3"),
        (
            dict(pp=4, vpp=2),
            r"--pp 4 --vpp 2 --ep 1: 8 pipeline segments \(PP x VPP\) but the model has 6 blocks",
        ),
        (dict(vpp=2), r"--vpp 2 needs pipeline stages to interleave"),
        (dict(tp=3), r"--tp 3: tensor-parallel size 3 must divide o_groups=2 .*; --tp 1, 2 fit this model"),
        (dict(pp=0), r"--pp must be a positive integer, got 0"),
    ],
)
def test_bad_layouts_are_refused_before_any_work(megatron_cpu, dirs, tmp_path, layout, message):
    plain, _ = dirs
    with pytest.raises(ValueError, match=message):
        convert_hf_to_megatron(plain, tmp_path / "mg", layout=TargetLayout(**layout))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_peak_memory_stays_within_the_bound(tmp_path):
    """A checkpoint 64 blocks deep, many times the bound: the conversion's peak resident memory above the process's
    memory after planning stays under 12 bytes x the largest tensor's elements (+ the fixed slack stated in
    :mod:`megatron_memory_case`), measured in a fresh process."""
    from megatron_memory_case import SLACK_BYTES, write_many_layer_checkpoint

    src, largest, nbytes = write_many_layer_checkpoint(tmp_path / "src", blocks=64)
    child = Path(__file__).parent / "megatron_memory_case.py"
    proc = subprocess.run(
        [sys.executable, str(child), str(src), str(tmp_path / "mg")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    bound = 12 * largest
    assert nbytes > 8 * (bound + SLACK_BYTES), (nbytes, bound)
    assert r["stream_peak"] <= bound + SLACK_BYTES, r
    assert (tmp_path / "mg" / ".metadata").is_file()
