"""tools/release.py, tools/release_history.py and tools/check_changelogs.py on a small throwaway git repository:
a uv workspace of two packages, ``base`` and ``top`` (``top`` depends on ``base>=0.1,<0.2``)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import check_changelogs
import pytest
import release
import release_history as rh

ROOT_PYPROJECT = """[project]
name = "ws"
version = "0.0.0"
requires-python = ">=3.12"
dependencies = ["base", "top"]

[tool.uv]
package = false

[tool.uv.workspace]
members = ["packages/*"]

[tool.uv.sources]
base = { workspace = true }
top = { workspace = true }
"""

PACKAGE = """[project]
name = "{name}"
version = "{version}"
requires-python = ">=3.12"
dependencies = [{deps}]
{sources}
[build-system]
requires = ["hatchling>=1.25"]
build-backend = "hatchling.build"
"""


def _git(repo: Path, *args: str) -> str:
    return rh.git(*args, root=repo)


def _write_package(repo: Path, name: str, version: str, deps: str = "", notes: str = "") -> None:
    pkg = repo / "packages" / name
    (pkg / "src" / name).mkdir(parents=True, exist_ok=True)
    (pkg / "src" / name / "__init__.py").write_text(f'__version__ = "{version}"\n')
    sources = "\n[tool.uv.sources]\nbase = { workspace = true }\n" if "base" in deps else ""
    (pkg / "pyproject.toml").write_text(
        PACKAGE.format(name=name, version=version, deps=deps, sources=sources)
    )
    (pkg / "CHANGELOG.md").write_text(f"# Changelog: {name}\n\n{notes}")


def _commit(repo: Path, message: str) -> str:
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", message)
    return _git(repo, "rev-parse", "HEAD").strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """base 0.1.0 and top 0.1.0 released in the first commit, base 0.1.1 in the second."""
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "config", "user.email", "t@example.com")
    _git(repo, "config", "user.name", "t")
    (repo / "pyproject.toml").write_text(ROOT_PYPROJECT)
    _write_package(repo, "base", "0.1.0", notes="## 0.1.0\n- First.\n")
    _write_package(repo, "top", "0.1.0", deps='"base>=0.1,<0.2"', notes="## 0.1.0\n- First.\n")
    _commit(repo, "0.1.0")
    _write_package(repo, "base", "0.1.1", notes="## 0.1.1\n- Fix.\n\n## 0.1.0\n- First.\n")
    _commit(repo, "base 0.1.1")
    return repo


def _changelog(repo: Path, name: str) -> Path:
    return repo / "packages" / name / "CHANGELOG.md"


def test_history_reads_the_commits_that_set_each_version(repo: Path) -> None:
    first, second = _git(repo, "rev-list", "--reverse", "HEAD").split()
    assert rh.releases("base", repo) == [
        rh.Release("base", "0.1.0", first),
        rh.Release("base", "0.1.1", second),
    ]
    assert [r.version for r in rh.releases("top", repo)] == ["0.1.0"]


def test_unchanged_changelogs_and_unreleased_notes_pass(repo: Path) -> None:
    path = _changelog(repo, "base")
    path.write_text(path.read_text().replace("## 0.1.1", "## Unreleased\n- Next.\n\n## 0.1.1"))
    assert check_changelogs.check_package("base", repo, None) == []
    assert check_changelogs.check_package("top", repo, None) == []


def test_an_edited_released_section_is_caught(repo: Path) -> None:
    path = _changelog(repo, "base")
    path.write_text(path.read_text().replace("- Fix.", "- Fix, and a later change."))
    errors = check_changelogs.check_package("base", repo, None)
    assert len(errors) == 1 and "'## 0.1.1'" in errors[0] and "released text was changed" in errors[0]
    assert "+- Fix, and a later change." in errors[0]
    # committing the edit does not make it released text
    _commit(repo, "edit")
    assert len(check_changelogs.check_package("base", repo, None)) == 1


def test_removed_unknown_and_misordered_sections_are_caught(repo: Path) -> None:
    path = _changelog(repo, "base")
    path.write_text("# Changelog: base\n\n## 0.1.1\n- Fix.\n\n## 0.3.0\n- Never released.\n")
    errors = "\n".join(check_changelogs.check_package("base", repo, None))
    assert "'## 0.1.0' (released at" in errors and "removed" in errors
    assert "'## 0.3.0' names a version that was never released" in errors
    assert "newest first" in errors


def test_edits_before_the_check_existed_stand(repo: Path) -> None:
    path = _changelog(repo, "base")
    path.write_text(path.read_text().replace("- First.", "- First (edited before the check)."))
    since = _commit(repo, "edit before the check")
    assert check_changelogs.check_package("base", repo, since) == []
    path.write_text(path.read_text().replace("(edited before the check)", "(edited after)"))
    assert len(check_changelogs.check_package("base", repo, since)) == 1


def test_shallow_or_missing_history_is_named(tmp_path: Path, repo: Path) -> None:
    shallow = tmp_path / "shallow"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{repo}", str(shallow)], check=True)
    with pytest.raises(rh.HistoryMissing, match=r"shallow clone.*git fetch --unshallow"):
        rh.require_history(shallow)
    assert check_changelogs.main(["--root", str(shallow)]) == 0  # says SKIPPED
    assert check_changelogs.main(["--root", str(shallow), "--require-history"]) == 1


def test_release_refuses_without_notes_and_when_already_released(repo: Path, capsys) -> None:
    assert release.main(["--root", str(repo), "release", "base", "--no-build"]) == 2
    assert "no '## Unreleased' section" in capsys.readouterr().err
    path = _changelog(repo, "base")
    path.write_text(path.read_text().replace("## 0.1.1", "## Unreleased\n- Fix.\n\n## 0.1.1"))
    _commit(repo, "notes equal to 0.1.1's")
    assert release.main(["--root", str(repo), "release", "base", "--no-build"]) == 2
    assert "the Unreleased notes are those of the released 0.1.1" in capsys.readouterr().err
    path.write_text(path.read_text().replace("## Unreleased\n- Fix.", "## Unreleased\n- Another fix."))
    _commit(repo, "notes")
    _git(repo, "tag", "base-v0.1.2")
    assert release.main(["--root", str(repo), "release", "base", "--no-build"]) == 2
    assert "base 0.1.2 was already released" in capsys.readouterr().err
    path.write_text(path.read_text() + "\n")
    assert release.main(["--root", str(repo), "release", "base", "--no-build"]) == 2
    assert "uncommitted changes" in capsys.readouterr().err


def test_breaking_release_bumps_minor_and_moves_the_dependants_range(repo: Path) -> None:
    path = _changelog(repo, "base")
    path.write_text(path.read_text().replace("## 0.1.1", "## Unreleased\n- Breaking: renamed.\n\n## 0.1.1"))
    _commit(repo, "notes")
    assert release.main(["--root", str(repo), "release", "base", "--no-build"]) == 0
    assert rh.current_version("base", repo) == "0.2.0"
    assert (
        repo / "packages" / "base" / "src" / "base" / "__init__.py"
    ).read_text() == '__version__ = "0.2.0"\n'
    assert rh.changelog_sections(path.read_text())["0.2.0"] == "- Breaking: renamed."
    top = (repo / "packages" / "top" / "pyproject.toml").read_text()
    assert '"base>=0.2,<0.3"' in top
    top_notes = rh.changelog_sections(_changelog(repo, "top").read_text())
    assert top_notes["Unreleased"] == "- Needs `base>=0.2,<0.3` (base 0.2.0 is a breaking release)."
    assert 'name = "base"\nversion = "0.2.0"' in (repo / "uv.lock").read_text()
    # the release is recorded: a commit, its tag, and the check still passes
    assert [r.version for r in rh.releases("base", repo)][-1] == "0.2.0"
    assert "base-v0.2.0" in rh.tags(repo)
    assert _git(repo, "status", "--porcelain", "--untracked-files=no") == ""
    assert check_changelogs.check_package("base", repo, None) == []
    assert check_changelogs.check_package("top", repo, None) == []


def test_patch_release_refuses_breaking_notes_and_tag_current(repo: Path, capsys) -> None:
    path = _changelog(repo, "top")
    path.write_text(path.read_text().replace("## 0.1.0", "## Unreleased\n- Breaking: gone.\n\n## 0.1.0"))
    _commit(repo, "notes")
    assert release.main(["--root", str(repo), "release", "top", "--patch", "--no-build"]) == 2
    assert "a patch release cannot break" in capsys.readouterr().err
    assert release.main(["--root", str(repo), "tag-current"]) == 0
    assert {"base-v0.1.1", "top-v0.1.0"} <= set(rh.tags(repo))
