"""tools/compat.py's choice of what to run, on a small throwaway git repository (the fixture of test_release.py):
``top`` depends on ``base>=0.1,<0.2``; base 0.1.0 and 0.1.1 are released, top 0.1.0."""

from __future__ import annotations

from pathlib import Path

import compat
from test_release import _commit, _write_package, repo  # noqa: F401 (the fixture)


def test_pins_and_closure(repo: Path) -> None:  # noqa: F811
    assert compat.pins(repo, "lowest") == {"base": "0.1.0", "top": "0.1.0"}
    assert compat.pins(repo, "previous") == {"base": "0.1.0", "top": "0.1.0"}
    assert compat.closure(repo, "top") == {"base"}
    assert compat.closure(repo, "base") == set()


def test_only_releases_with_other_code_than_the_working_tree_count(repo: Path) -> None:  # noqa: F811
    # base 0.1.0 differs from the working tree (0.1.1); top 0.1.0 is the working tree's code
    assert compat.differing(repo, {"base": "0.1.0", "top": "0.1.0"}) == {"base"}
    # the current release of base is the working tree: top's run would repeat `nox -s test`
    assert compat.differing(repo, {"base": "0.1.1", "top": "0.1.0"}) == set()
    # an unreleased (even uncommitted) change of base makes its current release differ
    init = repo / "packages" / "base" / "src" / "base" / "__init__.py"
    init.write_text(init.read_text() + "CHANGED = True\n")
    assert compat.differing(repo, {"base": "0.1.1", "top": "0.1.0"}) == {"base"}
    _commit(repo, "unreleased change")
    assert compat.differing(repo, {"base": "0.1.1", "top": "0.1.0"}) == {"base"}
    _write_package(repo, "top", "0.1.0", deps='"base>=0.1.1,<0.2"', notes="## 0.1.0\n- First.\n")
    assert compat.pins(repo, "lowest")["base"] == "0.1.1"  # the range floor moved up
