"""Tests of the repository tools (run by `nox -s dag`): the tools are scripts in tools/, not an installed package."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
