"""The functional E2E goldens (D9): the tiny-preset case of functional_case.py (mHC, MTP, hash + learned MoE,
packed THD through the dp-balanced scheduler, mock data from the CLI, a dense warm-up step, evaluation, resume)
reproduces its committed per-step LM / MTP losses and evaluation losses within the committed tolerance (derived
from the measured run-to-run variation: tools/regen_functional_goldens.py), and the resumed run repeats the steps
after the checkpoint bit for bit. A deliberate change of the numbers: rerun the tool, which records the reason."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from functional_case import ARGV, GOLDENS, differences, run_case

pytestmark = pytest.mark.slow


def test_functional_case_matches_goldens(tmp_path):
    golden = json.loads(GOLDENS.read_text())
    assert golden["argv"] == ARGV, (
        "the case changed: regenerate the goldens (tools/regen_functional_goldens.py)"
    )
    assert golden["history"] and all(h["reason"] for h in golden["history"])
    got = run_case(tmp_path, golden["threads"])
    assert got["resume_exact"], "the resumed run must repeat steps 3-4 and their evaluation bit for bit"
    diff = differences(golden, got, golden["tolerance"]["rel"])
    assert not diff, "\n".join(
        [*diff, "deliberate? run tools/regen_functional_goldens.py --reason '...' and commit the JSON"]
    )


def test_differences_name_each_value_outside_the_tolerance():
    golden = {"train": [{"step": 1, "lm_loss": 6.0, "mtp_loss": 6.0}], "eval": [], "history": []}
    got = {"train": [{"step": 1, "lm_loss": 6.0 * (1 + 2e-4), "mtp_loss": 6.0}], "eval": []}
    (line,) = differences(golden, got, 1e-4)
    assert line.startswith("train step 1 lm_loss: ") and "rel. diff 2.00e-04 > 1.0e-04" in line
    assert differences(golden, got, 1e-3) == []
    assert differences(golden, {"train": [], "eval": []}, 1e-3) == ["train: steps [] (golden: [1])"]
