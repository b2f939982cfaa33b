"""Tests of the repository tools (run by `nox -s dag`): the tools are scripts in tools/, not an installed package.
tools/tests itself is on the path too: test_compat.py reuses test_release.py's throwaway repository."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
