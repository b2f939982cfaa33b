"""Write ci/test_weights.json (seconds per test file) from the junit XML reports of a `nox -s test_all` run.

    python3 ci/test_weights.py .reports > ci/test_weights.json

`nox -s test_all` plans its pool of pytest jobs by these weights (noxfile.py `plan_jobs`: which package to split,
which job to start first) and `nox -s test` splits one package's files (`shard_files`); a file missing from the
table counts as `DEFAULT_WEIGHT`. Refresh it when tests move a lot.
"""

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def main(folder: str) -> int:
    root = Path(__file__).resolve().parent.parent
    weights: dict[str, float] = defaultdict(float)
    for report in sorted(Path(folder).glob("*.xml")):
        if report.name.startswith("compat-"):  # tools/compat.py's runs of the same files on released siblings
            continue
        for case in ET.parse(report).getroot().iter("testcase"):
            parts = case.get("classname", "").split(".")
            # classname: packages.<pkg>.tests[.<dir>].test_<name>[.<Class>]: the longest prefix that is a file
            for n in range(len(parts), 0, -1):
                path = "/".join(parts[:n]) + ".py"
                if (root / path).is_file():
                    weights[path] += float(case.get("time", 0.0))
                    break
    json.dump({k: round(v, 1) for k, v in sorted(weights.items())}, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else ".reports"))
