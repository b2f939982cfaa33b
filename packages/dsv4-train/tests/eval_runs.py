"""gloo workers of test_train_eval_parallel.py: train and evaluate one or several layouts in one set of processes
(module-level functions: ``run_distributed`` pickles them into spawned workers)."""

from __future__ import annotations

EVAL_KEYS = ("step", "eval_lm_loss", "eval_mtp_loss", "eval_ppl", "eval_tokens")


def evaluate_layouts(rank: int, world: int, runs: list[tuple[str, dict]], save_initial: bool = False) -> dict:
    """For each ``(name, TrainConfig kwargs)``: evaluate the initial weights, train (evaluating as configured);
    ``{name: [eval records]}`` (every rank returns the reduced records)."""
    from parallel_runs import run_trainer

    results = {}
    for name, kw in runs:
        trainer = run_trainer(kw)
        try:
            if save_initial:
                trainer.save_checkpoint()  # iter_0000000: the initial weights every layout starts from
            if kw.get("init_from"):  # run() loads them too; the evaluation of step 0 needs them now
                trainer.load_model_weights(kw["init_from"])
            first = trainer.evaluator(0)
            trainer.run()
        finally:
            trainer.close()
        results[name] = [{k: m.get(k) for k in EVAL_KEYS} for m in [first, *trainer.eval_metrics]]
    return results
