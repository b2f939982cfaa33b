"""Evaluation in ``dsv4 train`` on one CPU process (tiny preset, a few steps, one subprocess for every case):

* eval mode gives the training forward's LM and MTP losses on the same weights and batch (up to the fp32 rounding
  of the training loss's division);
* evaluating changes nothing in training: the training metrics with ``--eval-interval 1`` equal a run without
  evaluation bit for bit (no RNG draws, no router loads, no tracker entries), and the evaluation rows,
  TensorBoard events and ``loss.png`` are written;
* a resumed run holds out the same documents: its evaluation after the resume equals the uninterrupted run's.

Parallel layouts: test_train_eval_parallel.py."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

_RUNNER = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from dsv4_train.config import TrainConfig
    from dsv4_train.outputs import read_metrics
    from dsv4_train.trainer import Trainer

    TRAIN = ("lm_loss", "mtp_loss", "grad_norm", "lr", "balance_loss", "indexer_loss")
    EVAL = ("eval_lm_loss", "eval_mtp_loss", "eval_ppl", "eval_tokens")

    def run(pre_eval=False, **kw):
        t = Trainer(TrainConfig.from_flat(progress=False, **kw))
        try:
            before = t.evaluator(0) if pre_eval else None
            ms = t.run()
        finally:
            t.close()
        return before, [{k: m.get(k) for k in TRAIN} for m in ms], [{k: m[k] for k in EVAL} for m in t.eval_metrics]

    if __name__ == "__main__":
        out, data = Path(sys.argv[1]), sys.argv[2]
        base = dict(data=[data], seq_len=64, global_batch_size=2, micro_batch_size=2, warmup_steps=0)
        res = {}
        before, train, _ = run(True, **dict(base, steps=1), eval_interval=1, eval_iters=1, eval_data=[data], out=str(out / "a"))
        res["a"] = dict(before=before, train=train)
        packed = dict(base, micro_batch_size=1, packed=True, steps=3)
        res["plain"] = run(**packed, out=str(out / "plain"))[1]
        _, train, evals = run(**packed, eval_interval=1, eval_iters=2, eval_data=[data], out=str(out / "b"))
        rows = read_metrics(out / "b" / "metrics.jsonl")
        res["b"] = dict(train=train, evals=evals, rows=rows, png=(out / "b" / "loss.png").is_file(),
                        tb=sorted(p.name[:20] for p in (out / "b" / "tb").iterdir()))
        # default evaluation data: the held-out split; resume at step 2 and evaluate again at step 3
        heldout = dict(base, steps=3, eval_interval=2, eval_iters=2, save_interval=2, out=str(out / "c"))
        _, train, evals = run(**heldout)
        (out / "c" / "checkpoints" / "latest").write_text("iter_0000002")
        _, train2, evals2 = run(**dict(heldout, resume=True))
        res["c"] = dict(train=train, evals=evals, train2=train2, evals2=evals2,
                        rows=read_metrics(out / "c" / "metrics.jsonl"))
        print("RESULT " + json.dumps(res))
    """
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eval")
    data = tmp / "docs.jsonl"
    words = [
        "the",
        "model",
        "reads",
        "packed",
        "documents",
        "and",
        "predicts",
        "the",
        "next",
        "token",
        "of",
        "each",
        "one",
    ]
    data.write_text(
        "".join(
            json.dumps({"text": " ".join(words[(i * 7 + j) % len(words)] for j in range(2 + i % 8))}) + "\n"
            for i in range(40)
        )
    )
    script = tmp / "run_eval.py"
    script.write_text(_RUNNER)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp), str(data)],
        capture_output=True,
        text=True,
        timeout=1200,
        env=dict(os.environ, OMP_NUM_THREADS="2"),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :])


def test_eval_mode_losses_are_the_training_forward_losses(runs):
    # documents shorter than --seq-len: the global batch of 2 is one micro-batch of 2 rows; the eval batch is the first
    # training batch (same data, same seed order); the initial weights
    before, (step1,) = runs["a"]["before"], runs["a"]["train"]
    assert before["step"] == 0 and before["eval"] is True
    # the same per-token losses; the training loss divides its fp32 sum in fp32, the evaluation in fp64: one fp32
    # rounding (relative 2**-24) apart
    assert before["eval_lm_loss"] == pytest.approx(step1["lm_loss"], rel=2**-23, abs=0)
    assert before["eval_mtp_loss"] == pytest.approx(step1["mtp_loss"], rel=2**-23, abs=0)
    assert before["eval_ppl"] == pytest.approx(2.718281828459045 ** before["eval_lm_loss"], rel=1e-12)


def test_evaluation_does_not_change_training_and_is_written(runs):
    b = runs["b"]
    assert b["train"] == runs["plain"]  # bit for bit: every training metric of every step
    assert [e["eval_tokens"] for e in b["evals"]] == [b["evals"][0]["eval_tokens"]] * 3  # the same batches
    assert len({e["eval_lm_loss"] for e in b["evals"]}) == 3  # ... on weights that change
    kinds = [(r["step"], bool(r.get("eval"))) for r in b["rows"]]
    assert kinds == [(1, False), (1, True), (2, False), (2, True), (3, False), (3, True)]
    for r in b["rows"]:
        assert ("eval_lm_loss" in r) == bool(r.get("eval")) and ("lm_loss" in r) != bool(r.get("eval"))
    assert b["png"] and any(name.startswith("events.out.tfevents") for name in b["tb"])


def test_resume_holds_out_the_same_documents(runs):
    c = runs["c"]
    assert [e["eval_tokens"] for e in c["evals"]] == [c["evals"][0]["eval_tokens"]] * 2  # steps 2 and 3
    assert c["train2"] == c["train"][2:]
    assert c["evals2"] == c["evals"][1:]  # the evaluation of step 3 after the resume at step 2: identical
    steps = [(r["step"], bool(r.get("eval"))) for r in c["rows"]]
    assert steps == [(1, False), (2, False), (2, True), (3, False), (3, True)]  # the kept eval row of step 2
