"""Run outputs of ``dsv4 train``: progress bar, ``metrics.jsonl``, TensorBoard events and ``loss.png``."""

from __future__ import annotations

import json
from pathlib import Path


class RunOutputs:
    """Writes the per-step metrics of one run (only on the logging rank: ``enabled``)."""

    def __init__(self, out: Path, *, enabled: bool, append: bool, total: int, progress: bool = True) -> None:
        self.out, self.enabled, self.total = Path(out), enabled, total
        self._append, self._progress = append, progress
        self.bar = None
        self.writer = None
        self._file = None

    def start(self, initial: int = 0) -> None:
        if not self.enabled:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / "metrics.jsonl"
        if self._append and path.exists():
            kept = [
                line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= initial
            ]
            path.write_text("".join(line + "\n" for line in kept))
        elif path.exists():
            path.unlink()
        self._file = path.open("a")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(self.out / "tb"), purge_step=initial + 1 if self._append else None)
        if self._progress:
            from tqdm import tqdm

            self.bar = tqdm(
                total=self.total, initial=initial, desc="dsv4 train", unit="step", dynamic_ncols=True
            )

    def log(self, m: dict) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(m) + "\n")
        self._file.flush()
        for k, v in m.items():
            if k != "step" and isinstance(v, int | float) and not isinstance(v, bool):
                self.writer.add_scalar(f"train/{k}", v, m["step"])
        if self.bar is not None:
            post = {"loss": f"{m.get('lm_loss', float('nan')):.3f}", "tok/s": f"{m['tokens_per_s']:.0f}"}
            post["mfu"] = f"{100 * m['mfu']:.2f}%"
            self.bar.set_postfix(post)
            self.bar.update(1)

    def note(self, text: str) -> None:
        if self.enabled:
            (self.bar.write if self.bar is not None else print)(text)

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
    """``loss.png``: LM (and MTP) loss over steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in (("lm_loss", "LM loss"), ("mtp_loss", "MTP loss")):
        pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts), label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("dsv4 train")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
