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
from dsv4_train.generate_cli import decode_mode
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
    static = _json(
        capsys,
        ["--checkpoint", str(run_dir), "--prompt-ids", "5,6,7", "--prompt-ids", "9", "--max-new-tokens", "6"]
        + ["--decode", "static"],
    )
    assert static["ids"] == got["ids"]
    spec = _json(
        capsys,
        ["--checkpoint", str(run_dir), "--prompt-ids", "5,6,7", "--prompt-ids", "9", "--max-new-tokens", "6"]
        + ["--speculative", "mtp"],
    )
    assert spec["ids"] == got["ids"]  # greedy speculative decoding: plain greedy's tokens
    report = spec["speculative"]
    assert (
        report["mode"] == "mtp"
        and 0 < report["drafted"] <= 10
        and 0 <= report["accepted"] <= report["drafted"]
    )
    assert report["acceptance_rate"] == round(report["accepted"] / report["drafted"], 4)
    static_spec = _json(
        capsys,
        ["--checkpoint", str(run_dir), "--prompt-ids", "5,6,7", "--prompt-ids", "9", "--max-new-tokens", "6"]
        + ["--speculative", "mtp", "--decode", "static"],
    )
    assert static_spec == spec  # the static speculative step: the eager loop's tokens and counters
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
        pytest.param(
            ["--prompt-ids", "1", "--decode", "graph"],
            "needs the model on a CUDA device",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="the CLI decodes on CUDA there"),
        ),
    ],
)
def test_bad_inputs_exit_2_with_one_message(megatron_cpu, run_dir, capsys, argv, match):
    where = ["--checkpoint", str(run_dir / "missing" if "is not a directory" in match else run_dir)]
    assert main(["generate", *where, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dsv4 generate: error: ") and match in err, err


def test_generate_from_transformers_equals_its_full_forward_greedy(megatron_cpu, tmp_path, capsys):
    """``dsv4 generate --checkpoint HFDIR --prompt-ids ...`` on a tiny random transformers DeepSeek-V4 (W C H, hash
    MoE, mHC) continues the prompt as transformers' full forward (no cache) does greedily, up to near ties (a top-2
    gap under twice the fp32 parity bound ends the comparison; the full oracle is hybrid-model's
    ``test_generation_hf_oracle.py``)."""
    import transformers

    cfg = transformers.DeepseekV4Config(
        vocab_size=64,
        hidden_size=32,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        head_dim=16,
        q_lora_rank=16,
        partial_rotary_factor=0.5,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe"],
        n_routed_experts=8,
        num_experts_per_tok=2,
        sliding_window=8,
        o_groups=2,
        o_lora_rank=8,
        index_n_heads=8,
        index_head_dim=16,
        index_topk=4,
    )
    torch.manual_seed(3)
    hf_model = transformers.DeepseekV4ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            p.add_(
                torch.randn(p.shape, generator=g)
                * (1.0 if name.endswith(("sinks", "position_bias")) else 0.15)
            )
        for name, b in hf_model.named_buffers():
            if name.endswith("tid2eid"):  # HF's placeholder table is all zeros: distinct experts per token
                b.copy_(
                    torch.stack([torch.randperm(8, generator=g)[: b.shape[1]] for _ in range(b.shape[0])])
                )
    hf_model.save_pretrained(tmp_path)
    prompt = torch.randint(0, 64, (130,), generator=g).tolist()  # past the first ratio-128 block
    got = _json(
        capsys,
        ["--checkpoint", str(tmp_path), "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", "12"],
    )
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            logits = hf_model(torch.tensor([ids]), use_cache=False).logits[0, -1]  # [V]
            top2 = logits.topk(2).values
            if top2[0] - top2[1] < 2e-5 * max(1.0, float(logits.abs().max())):
                break  # a near tie: the argmaxes may differ from here
            ids.append(int(logits.argmax()))
    assert len(ids) - len(prompt) >= 6, "near ties end the comparison too early"
    assert got["ids"][0][: len(ids) - len(prompt)] == ids[len(prompt) :]


@pytest.mark.parametrize(
    "requested, device, speculative, expected",
    [
        ("auto", "cuda", None, "graph"),  # the default on a GPU: the decode step as CUDA graphs
        ("auto", "cuda", "mtp", "eager"),  # until the static speculative graphs have run on a GPU
        ("graph", "cuda", "mtp", "graph"),  # on request
        ("auto", "cpu", None, "eager"),
        ("eager", "cuda", None, "eager"),
        ("static", "cuda", None, "static"),
        ("graph", "cpu", None, "graph"),  # as given: generate refuses it on the CPU with one message
    ],
)
def test_decode_mode_auto_is_graph_on_cuda_and_eager_elsewhere(requested, device, speculative, expected):
    assert decode_mode(requested, torch.device(device), speculative) == expected
