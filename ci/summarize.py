"""Sum the junit XML reports that `nox -s test_all` (or `test`) writes and print one `N passed, N failed, N skipped` line.

Exit status 1 when a test failed or when no test ran at all.
"""

import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def main(folder: str) -> int:
    tests = failed = skipped = 0
    for report in sorted(Path(folder).glob("*.xml")):
        for suite in ET.parse(report).getroot().iter("testsuite"):
            tests += int(suite.get("tests", 0))
            failed += int(suite.get("failures", 0)) + int(suite.get("errors", 0))
            skipped += int(suite.get("skipped", 0))
    passed = tests - failed - skipped
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed or passed == 0 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else ".reports"))
