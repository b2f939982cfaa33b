"""Run outputs of ``dsv4 train``: progress (a bar on a terminal, one line every ``log_interval`` steps otherwise),
``metrics.jsonl`` (strict JSON: non-finite numbers are written as ``null``), TensorBoard events and ``loss.png``."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from dsv4_train.evaluation import eval_line


def strict_json_row(m: dict) -> str:
    """``m`` as one line of strict JSON: non-finite floats (NaN, ±inf) become ``null``."""
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in m.items()}
    return json.dumps(clean, allow_nan=False)


def read_metrics(path: Path) -> list[dict]:
    """The rows of a ``metrics.jsonl``; ``ValueError`` naming the file and line for a line that is not a JSON
    object with a ``step`` (a last line without its newline, cut off by a killed run, is dropped)."""
    text = Path(path).read_text()
    # every row ends with a newline: the last piece is empty, or a row cut off by a killed run (dropped)
    lines = text.split("\n")[:-1]
    rows = []
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            int(row["step"])
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(
                f"{path}, line {i}: not a metrics row ({e}): delete or fix that line (rows after the checkpoint "
                "are rewritten by the resumed run anyway)"
            ) from e
        rows.append(row)
    return rows


def progress_line(m: dict, total: int) -> str:
    """One log line of step ``m`` (the progress of non-interactive runs)."""
    parts = [f"step {m['step']}/{total}"]
    depths = sorted((k for k in m if k.startswith("mtp_loss_")), key=lambda k: int(k.rsplit("_", 1)[1]))
    keys = [("lm_loss", ".4f"), ("mtp_loss", ".4f")] + [(k, ".4f") for k in depths]
    for key, fmt in keys + [("grad_norm", ".3f"), ("lr", ".3e")]:
        v = m.get(key)
        if v is not None:
            parts.append(f"{key} {v:{fmt}}")
    parts.append(f"{m['tokens_per_s']:.0f} tok/s")
    parts.append(f"mfu {100 * m['mfu']:.2f}%")
    if m.get("nonfinite"):
        parts.append("NON-FINITE")
    if m.get("skipped"):
        parts.append("update skipped")
    return "dsv4 train: " + " | ".join(parts)


class RunOutputs:
    """Writes the per-step metrics of one run (only on the logging rank: ``enabled``)."""

    def __init__(
        self,
        out: Path,
        *,
        enabled: bool,
        append: bool,
        total: int,
        progress: bool = True,
        log_interval: int = 1,
    ) -> None:
        self.out, self.enabled, self.total = Path(out), enabled, total
        self._append, self._progress, self._log_interval = append, progress, log_interval
        self.bar = None
        self.writer = None
        self._file = None

    def start(self, initial: int = 0) -> None:
        if not self.enabled:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / "metrics.jsonl"
        if self._append and path.exists():
            kept = [row for row in read_metrics(path) if row["step"] <= initial]
            path.write_text("".join(strict_json_row(row) + "\n" for row in kept))
        elif path.exists():
            path.unlink()
        self._file = path.open("a")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(self.out / "tb"), purge_step=initial + 1 if self._append else None)
        if self._progress and sys.stdout.isatty():
            from tqdm import tqdm

            self.bar = tqdm(
                total=self.total, initial=initial, desc="dsv4 train", unit="step", dynamic_ncols=True
            )

    def log(self, m: dict) -> None:
        if not self.enabled:
            return
        self._file.write(strict_json_row(m) + "\n")
        self._file.flush()
        for k, v in m.items():
            if k != "step" and isinstance(v, int | float) and not isinstance(v, bool):
                self.writer.add_scalar(f"train/{k}", v, m["step"])
        if self.bar is not None:
            loss = m.get("lm_loss")
            post = {"loss": f"{loss:.3f}" if loss is not None else "-", "tok/s": f"{m['tokens_per_s']:.0f}"}
            post["mfu"] = f"{100 * m['mfu']:.2f}%"
            self.bar.set_postfix(post)
            self.bar.update(1)
        elif self._progress and (m["step"] % self._log_interval == 0 or m["step"] == self.total):
            print(progress_line(m, self.total), flush=True)

    def log_eval(self, m: dict) -> None:
        """Write an evaluation record (:mod:`dsv4_train.evaluation`): its ``metrics.jsonl`` row,
        TensorBoard ``eval/*`` scalars and a progress note."""
        if not self.enabled:
            return

        self._file.write(strict_json_row(m) + "\n")
        self._file.flush()
        for k, v in m.items():
            if k.startswith("eval_") and isinstance(v, int | float) and not isinstance(v, bool):
                self.writer.add_scalar(f"eval/{k.removeprefix('eval_')}", v, m["step"])
        if self._progress:
            self.note(eval_line(m))

    def note(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(f"dsv4 train: {text}")
        else:
            print(f"dsv4 train: {text}", flush=True)

    def close(self) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            self.writer.close()
        if self._file is not None:
            self._file.close()
        plot_loss(self.out / "metrics.jsonl", self.out / "loss.png")


def plot_loss(metrics_path: Path, png_path: Path) -> None:
    """``loss.png``: LM (and MTP) loss over steps (non-finite steps are gaps), evaluation losses as points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    fig, ax = plt.subplots(figsize=(7, 4))
    plotted = False
    depth_keys = sorted(
        {k for r in rows for k in r if k.startswith("mtp_loss_")}, key=lambda k: int(k.rsplit("_", 1)[1])
    )
    labels = [("lm_loss", "LM loss"), ("mtp_loss", "MTP loss")] + [
        (k, f"MTP loss, depth {k[9:]}") for k in depth_keys
    ]
    for key, label in labels:
        pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts), label=label)
            plotted = True
    for key, label, color in (
        ("eval_lm_loss", "eval LM loss", "C0"),
        ("eval_mtp_loss", "eval MTP loss", "C1"),
    ):
        pts = [(r["step"], r[key]) for r in rows if r.get("eval") and r.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts), "o--", color=color, markersize=5, linewidth=0.8, label=label)
            plotted = True
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("dsv4 train")
    if plotted:
        ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
