"""Write ``refactor_fixture.pt``: the outputs of :mod:`_refactor_cases` (recorded at commit ``784234d``)."""

from __future__ import annotations

import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

if __name__ == "__main__":
    from _refactor_cases import CASES, run_case
    from megatron.core.process_groups_config import ProcessGroupCollection

    from dsv4_testkit.megatron_cpu import megatron_cpu_context

    data = {}
    for name in CASES:
        with megatron_cpu_context():
            data[name] = run_case(name, ProcessGroupCollection.use_mpu_process_groups())
    torch.save(data, os.path.join(HERE, "refactor_fixture.pt"))
    print({k: len(v) for k, v in data.items()})
