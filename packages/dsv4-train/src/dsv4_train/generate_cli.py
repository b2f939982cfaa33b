"""``dsv4 generate``: sample from a ``dsv4 train`` run (or checkpoint), a ``dsv4 convert`` output or a Hugging Face
DeepSeek-V4 directory, with the model's cached decoding (:func:`hybrid_model.generation.generate`).

Prompts are text (``--prompt``, tokenized with the run's tokenizer: its ``--tokenizer`` file, or the byte-level
tokenizer it trained with; an HF directory's ``tokenizer.json``; or ``--tokenizer``) or token ids
(``--prompt-ids 1,2,3``); both repeat for a batch. One process, one device (CUDA when present).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from dsv4_primitives.megatron import cuda_as_cpu
from dsv4_train.checkpoint import TRAIN_CONFIG_FILE
from dsv4_train.convert_cli import run_model_config, verify_train_checkpoint
from dsv4_train.setup import init_distributed
from hybrid_model.generation import DECODE_MODES, SpeculationStats, generate
from hybrid_model.hf import load_hf_checkpoint, load_megatron_checkpoint
from thd_packing import load_tokenizer


def add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="sample continuations of prompts from a trained or imported model")
    p.add_argument(
        "--checkpoint",
        required=True,
        help="a dsv4 train run directory (its checkpoints/latest) or iter_XXXXXXX, a dsv4 convert output, or an HF "
        "DeepSeek-V4 directory (config.json + safetensors)",
    )
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="a text prompt (repeatable)")
    p.add_argument(
        "--prompt-ids",
        action="append",
        default=[],
        metavar="IDS",
        help="a prompt as token ids, e.g. 1,2,3 (repeatable)",
    )
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens generated per prompt (default: 32)")
    p.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy; else the softmax temperature (default: 0)"
    )
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default: 1)")
    p.add_argument("--seed", type=int, help="seed of the sampling generator (default: none)")
    p.add_argument(
        "--tokenizer",
        help="HF tokenizers JSON file for --prompt and the text output (default: the checkpoint's)",
    )
    p.add_argument(
        "--decode",
        choices=("auto", *DECODE_MODES),
        default="auto",
        help="how decode steps run: eager (host plans), static (static shapes, device-side lengths) or graph (the "
        "static step as a CUDA graph; CUDA only); all give the same tokens, with --speculative too (greedy) (default: "
        "auto = graph on CUDA, eager on the CPU or with --speculative)",
    )
    p.add_argument(
        "--speculative",
        choices=["mtp"],
        help="speculative decoding: mtp = the model's MTP head drafts one token per step, the model verifies it "
        "(greedy: the same tokens as plain decoding; sampling: the same distribution); with --decode static / "
        "graph the verify steps run on static shapes, acceptance and rollback on the device; the acceptance rate "
        "is printed (--json: its 'speculative' field)",
    )
    p.add_argument(
        "--json", action="store_true", help='print {"ids": [[...]], "text": [...]} and nothing else'
    )


def decode_mode(requested: str, device: torch.device, speculative: str | None = None) -> str:
    """The decode mode ``--decode requested`` runs: ``auto`` is ``graph`` on CUDA (the decode step replayed as one
    CUDA graph: about 10x the eager step's tokens/s at batch 1 on an H100, hybrid-model README "Generation") and
    ``eager`` on the CPU; with ``--speculative``, ``auto`` stays ``eager`` until the static speculative step's
    graphs have run on a GPU (``--decode static`` / ``graph`` run it on request); any other mode as given."""
    if requested != "auto":
        return requested
    return "graph" if device.type == "cuda" and speculative is None else "eager"


def _prompt_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError as e:
        raise ValueError(f"--prompt-ids {text!r} must be comma-separated token ids, e.g. 1,2,3") from e


def _tokenizer_spec(path: Path, override: str | None) -> str | None:
    """The tokenizer of the checkpoint at ``path``: ``override``, an HF directory's ``tokenizer.json``, a train
    run's ``--tokenizer`` (``None`` = byte-level); ``"missing"`` for an HF directory without one."""
    if override:
        return override
    if (path / "config.json").is_file():
        return str(path / "tokenizer.json") if (path / "tokenizer.json").is_file() else "missing"
    for saved in sorted(path.rglob(TRAIN_CONFIG_FILE)):
        return json.loads(saved.read_text()).get("data", {}).get("tokenizer")
    return None


def _load_model(path: Path, device: torch.device):
    if not path.is_dir():
        raise ValueError(f"--checkpoint {path} is not a directory")
    if (path / "config.json").is_file():
        return load_hf_checkpoint(path, device)
    if not any(
        (d / "metadata.json").is_file() or (d / "latest").is_file() for d in (path, path / "checkpoints")
    ):
        raise ValueError(
            f"--checkpoint {path} is neither an HF checkpoint (config.json) nor a megatron dist checkpoint or dsv4 "
            "train run (metadata.json, checkpoints/latest)"
        )
    verify_train_checkpoint(path, f"dsv4 generate --checkpoint {path}", "generate")
    init_distributed()  # megatron's checkpoint reader needs a process group (one local process)
    with cuda_as_cpu():
        return load_megatron_checkpoint(path, device, model_config=run_model_config(path))


def run_generate(args) -> int:
    path = Path(args.checkpoint)
    prompts = [_prompt_ids(t) for t in args.prompt_ids]
    spec = _tokenizer_spec(path, args.tokenizer) if path.is_dir() else None
    if args.prompt and spec == "missing":
        raise ValueError(
            f"--prompt needs a tokenizer, and {path} has no tokenizer.json: pass --tokenizer FILE or --prompt-ids"
        )
    tokenizer = None if spec == "missing" else load_tokenizer(spec)
    prompts = [tokenizer.encode(t) for t in args.prompt] + prompts if args.prompt else prompts
    if not prompts:
        raise ValueError("give at least one --prompt TEXT or --prompt-ids 1,2,3")
    speculative = args.speculative
    stats = SpeculationStats() if speculative is not None else None
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    decode = decode_mode(args.decode, device, args.speculative)
    model = _load_model(path, device)
    stream = sys.stdout.isatty() and not args.json and len(prompts) == 1 and tokenizer is not None
    streamed: list[int] = []

    def on_token(_seq: int, token: int) -> None:  # the new text of one prompt on a terminal
        before = tokenizer.decode(streamed)
        streamed.append(token)
        print(tokenizer.decode(streamed)[len(before) :], end="", flush=True)

    out = generate(
        model,
        prompts,
        args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        on_token=on_token if stream else None,
        decode=decode,
        speculative=speculative,
        stats=stats,
    )
    texts = [tokenizer.decode(ids) for ids in out] if tokenizer is not None else None
    report = None
    if speculative is not None:
        report = {
            "mode": speculative,
            "drafted": stats.drafted,
            "accepted": stats.accepted,
            "acceptance_rate": round(stats.acceptance_rate, 4),
            "verify_steps": stats.steps,
        }
    if args.json:
        result = {"ids": out, "text": texts}
        if report is not None:
            result["speculative"] = report
        print(json.dumps(result))
        return 0
    if stream:
        print()
    else:
        for i, ids in enumerate(out):
            print(f"[{i}] {texts[i] if texts is not None else ','.join(map(str, ids))}")
    if report is not None:
        print(
            f"speculative {speculative}: {report['accepted']}/{report['drafted']} drafts accepted "
            f"({100 * stats.acceptance_rate:.1f}%), {report['verify_steps']} verify steps",
            file=sys.stderr,
        )
    return 0
