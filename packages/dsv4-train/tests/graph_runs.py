"""Run a ``--cuda-graph`` GPU test's training script in a fresh process (each run owns its CUDA graphs and parallel
state) and read back the one ``RESULTS {json}`` line it prints."""

import json
import os
import subprocess
import sys


def run_results_script(tmp_path, source: str) -> dict:
    """Write ``source`` to ``tmp_path/run.py``, run it with ``tmp_path`` as its argument (deterministic cuBLAS
    workspace) and return its ``RESULTS`` dict; fails with the output tail when the line is missing."""
    script = tmp_path / "run.py"
    script.write_text(source)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, env=env, timeout=900
    )
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert line, (proc.stdout + proc.stderr)[-4000:]
    return json.loads(line[0][len("RESULTS ") :])
