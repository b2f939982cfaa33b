"""noxfile.py's test pool (`nox -s test_all`): which pytest jobs run, in which order."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from noxfile import DEFAULT_WEIGHT, plan_jobs  # noqa: E402


def test_only_a_package_heavier_than_a_slot_share_is_split_and_the_heaviest_jobs_start_first():
    files = {"big": ["b1", "b2", "b3", "b4"], "mid": ["m1", "m2"], "small": ["s1"], "none": []}
    weights = {"b1": 50.0, "b2": 40.0, "b3": 30.0, "b4": 20.0, "m1": 20.0, "m2": 15.0}  # s1: DEFAULT_WEIGHT
    jobs = plan_jobs(files, weights, 2)  # total 185: a slot's share 92.5; "big" (140) in 2 jobs
    assert jobs == [("big", ["b1", "b4"]), ("big", ["b2", "b3"]), ("mid", ["m1", "m2"]), ("small", ["s1"])]
    assert DEFAULT_WEIGHT < 35.0  # "small" is the lightest job above


def test_every_file_runs_once_in_a_job_of_its_own_package():
    files = {f"p{i}": [f"p{i}/t{j}" for j in range(i + 1)] for i in range(5)}
    weights = {f: float(len(f) * 7 % 11 + 1) for fs in files.values() for f in fs}
    for slots in (1, 2, 3):
        jobs = plan_jobs(files, weights, slots)
        assert sorted(f for _, g in jobs for f in g) == sorted(f for fs in files.values() for f in fs)
        assert all(f.startswith(pkg + "/") for pkg, g in jobs for f in g)
        load = [sum(weights[f] for f in g) for _, g in jobs]
        assert load == sorted(load, reverse=True)
    assert len(plan_jobs(files, weights, 1)) == 5  # one slot: one job per package
