"""The vocabulary of the support table (:mod:`dsv4_train.support`): the :class:`Machine` a run starts on, each
:class:`Feature` with the predicate that says when a run uses it (:data:`FEATURES`), and a :class:`Relation`: what
a set of features does together. Configs are read duck-typed (no import of :mod:`dsv4_train.config`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class Machine:
    """What a run knows only when it starts: the data-parallel size and whether CUDA is visible."""

    dp: int = 1
    cuda: bool = False


@dataclass(frozen=True)
class Feature:
    """A feature of a run: its name in the table, how a user turns it on, and when a run uses it."""

    name: str
    flag: str
    active: Callable[[Any, Machine | None], bool]
    #: whether ``active`` needs the machine (``None`` at config time)
    needs_machine: bool = False


def _machine(test: Callable[[Machine], bool]) -> Callable[[Any, Machine | None], bool]:
    return lambda tc, m: m is not None and test(m)


FEATURES: dict[str, Feature] = {
    f.name: f
    for f in (
        Feature("dp", "DP > 1 (world / (tp·pp·cp))", _machine(lambda m: m.dp > 1), needs_machine=True),
        Feature("tp", "--tp > 1", lambda tc, m: tc.parallel.tp > 1),
        Feature("pp", "--pp > 1", lambda tc, m: tc.parallel.pp > 1),
        Feature("vpp", "--vpp > 1", lambda tc, m: tc.parallel.vpp > 1),
        Feature("ep", "--ep > 1", lambda tc, m: tc.parallel.ep > 1),
        Feature("cp", "--cp > 1", lambda tc, m: tc.parallel.cp > 1),
        Feature("packed", "--packed", lambda tc, m: tc.data.packed),
        Feature("micro_batch", "--micro-batch-size > 1", lambda tc, m: tc.data.micro_batch_size > 1),
        Feature("cuda_graph", "--cuda-graph", lambda tc, m: tc.graphs.cuda_graph),
        Feature(
            "recompute", "--recompute-granularity", lambda tc, m: tc.memory.recompute_granularity is not None
        ),
        Feature("offload", "--optimizer-cpu-offload", lambda tc, m: tc.optimizer.optimizer_cpu_offload),
        Feature(
            "offload_overlap",
            "--optimizer-offload-overlap",
            lambda tc, m: tc.optimizer.optimizer_offload_overlap,
        ),
        Feature(
            "offload_defer",
            "--optimizer-offload-defer",
            lambda tc, m: tc.optimizer.optimizer_offload_defer,
        ),
        Feature("activation_offload", "--offload-activations", lambda tc, m: tc.memory.offload_activations),
        Feature(
            "fused_step",
            "--optimizer-impl fused-step",
            lambda tc, m: tc.optimizer.optimizer_impl == "fused-step",
        ),
        Feature(
            "deterministic",
            "--deterministic (default with CUDA)",
            # unset: on with CUDA (resolved when the run starts; at config time only an explicit --deterministic)
            lambda tc, m: (
                bool(tc.precision.deterministic)
                or (tc.precision.deterministic is None and m is not None and m.cuda)
            ),
        ),
        Feature("eval", "--eval-interval > 0", lambda tc, m: tc.eval.eval_interval > 0),
        Feature("resume", "--resume", lambda tc, m: bool(tc.checkpoint.resume)),
        Feature(
            "fp32",
            "--no-bf16",
            lambda tc, m: m is not None and tc.precision.bf16 is False,
            needs_machine=True,
        ),
        Feature("cpu", "no CUDA device", _machine(lambda m: not m.cuda), needs_machine=True),
    )
}


@dataclass(frozen=True)
class Relation:
    """What ``features`` do together (each active, and each of ``without`` inactive).

    ``reason``: for a refusal, the error message (``str.format`` fields: the config's flat fields and ``dp``);
    for a supported row, what is checked; for an untested row, what is known and why no test runs it.
    ``tested_by``: ``tests/FILE.py::test_name`` of a test that runs the combination (supported) or asserts the
    refusal; for an untested row, the test that checks the config accepts it.
    """

    features: tuple[str, ...]
    verdict: Literal["supported", "refused", "untested"]
    reason: str
    tested_by: str
    without: tuple[str, ...] = ()

    @property
    def when(self) -> str:
        """``"config"`` when the config alone decides the relation, else ``"run"``."""
        names = (*self.features, *self.without)
        return "run" if any(FEATURES[n].needs_machine for n in names) else "config"

    def applies(self, tc: Any, machine: Machine | None) -> bool:
        return all(FEATURES[n].active(tc, machine) for n in self.features) and not any(
            FEATURES[n].active(tc, machine) for n in self.without
        )

    def message(self, tc: Any, machine: Machine | None) -> str:
        return self.reason.format(**tc.flat(), dp=machine.dp if machine else 1)


__all__ = ["FEATURES", "Feature", "Machine", "Relation"]
