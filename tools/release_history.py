"""Release history of the workspace's packages, read from git (used by ``tools/release.py``, the CHANGELOG check
``tools/check_changelogs.py`` and the local index ``tools/build_index.py``).

A package's release is recorded by the commit that set its version: the first commit on the first-parent history
of ``HEAD`` whose ``packages/<name>/pyproject.toml`` carries ``version = "X.Y.Z"`` (so a release merged from a
branch is the merge commit on main). A git tag ``<name>-vX.Y.Z`` (``tools/release.py tag-current`` creates them)
names the same commit explicitly and wins when present. CHANGELOG sections are ``## X.Y.Z`` (released) and one
optional ``## Unreleased`` on top (what the next release will say).
"""

from __future__ import annotations

import re
import subprocess
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
UNRELEASED = "Unreleased"
VERSION_LINE = re.compile(r'^version = "([^"]+)"$', re.M)
SECTION = re.compile(r"^## (.+?)[ \t]*$", re.M)
RELEASE_VERSION = re.compile(r"^(\d+)\.(\d+)\.(\d+)$")
#: Releases whose commit the history reads wrongly, before tags existed. f6f8c4f set these version numbers on main,
#: and the merge 33c815b released them ("releases: ... hybrid-model 0.9.0, dsv4-testkit 0.3.0, dsv4-train 0.1.0" in
#: its message) with changed code and the sibling ranges that exclude the next breaking release.
RELEASED_AT = {
    ("hybrid-model", "0.9.0"): "33c815b",
    ("dsv4-testkit", "0.3.0"): "33c815b",
    ("dsv4-train", "0.1.0"): "33c815b",
}


@dataclass(frozen=True)
class Release:
    """One released version of one package and the commit that released it."""

    package: str
    version: str
    commit: str  # full sha


class HistoryMissing(RuntimeError):
    """The checkout has no (or only a shallow) git history, so past releases cannot be read."""


def git(*args: str, root: Path = ROOT) -> str:
    out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed in {root}: {out.stderr.strip()}")
    return out.stdout


def require_history(root: Path = ROOT) -> None:
    """Raise ``HistoryMissing`` (with the fix) when ``root`` is not a git checkout or a shallow clone."""
    try:
        shallow = git("rev-parse", "--is-shallow-repository", root=root).strip()
    except (RuntimeError, FileNotFoundError) as err:
        raise HistoryMissing(
            f"{root} is not a git checkout ({err}); release history needs a git clone"
        ) from err
    if shallow == "true":
        raise HistoryMissing(
            f"{root} is a shallow clone: release history is missing; run `git fetch --unshallow` (CI: clone with "
            "full history, e.g. actions/checkout with fetch-depth: 0)"
        )


def package_names(root: Path = ROOT) -> list[str]:
    return sorted(p.name for p in (root / "packages").iterdir() if (p / "pyproject.toml").is_file())


def parse_version(text: str) -> tuple[int, int, int]:
    m = RELEASE_VERSION.match(text)
    if m is None:
        raise ValueError(f"version {text!r} is not of the form X.Y.Z")
    return int(m[1]), int(m[2]), int(m[3])


def read_version(pyproject_text: str, where: str) -> str:
    m = VERSION_LINE.search(pyproject_text)
    if m is None:
        raise ValueError(f'{where}: no `version = "X.Y.Z"` line in [project]')
    return m[1]


def current_version(package: str, root: Path = ROOT) -> str:
    path = root / "packages" / package / "pyproject.toml"
    return read_version(path.read_text(), str(path))


def file_at(commit: str, path: str, root: Path = ROOT) -> str | None:
    """The text of ``path`` (relative to the repository root) at ``commit``; None when it does not exist there."""
    out = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=root, capture_output=True, text=True)
    return out.stdout if out.returncode == 0 else None


def tag_name(package: str, version: str) -> str:
    return f"{package}-v{version}"


def tags(root: Path = ROOT) -> dict[str, str]:
    """Every tag of the repository -> the commit it points to."""
    out = git(
        "for-each-ref", "--format=%(refname:short) %(objectname) %(*objectname)", "refs/tags", root=root
    )
    result = {}
    for line in out.splitlines():
        name, obj, *peeled = line.split()
        result[name] = peeled[0] if peeled else obj  # annotated tags: the tagged commit
    return result


def releases(package: str, root: Path = ROOT, rev: str = "HEAD") -> list[Release]:
    """The releases of ``package`` on the first-parent history of ``rev``, oldest first (a tag wins)."""
    require_history(root)
    path = f"packages/{package}/pyproject.toml"
    log = git(
        "log", "--first-parent", "--diff-merges=first-parent", "--no-patch", "--reverse", "--format=%H",
        "-G", "^version = ", rev, "--", path, root=root,
    )  # fmt: skip
    known = tags(root)
    found: dict[str, str] = {}
    for commit in log.split():
        text = file_at(commit, path, root)
        if text is None:
            continue
        version = read_version(text, f"{path} at {commit[:10]}")
        found.setdefault(version, commit)
    result = []
    for version, commit in found.items():
        if (package, version) in RELEASED_AT:
            commit = git("rev-parse", f"{RELEASED_AT[package, version]}^{{commit}}", root=root).strip()
        commit = known.get(tag_name(package, version), commit)
        result.append(Release(package, version, commit))
    return sorted(result, key=lambda r: parse_version(r.version))


def changelog_sections(text: str) -> dict[str, str]:
    """``## <title>`` -> the section's text (its lines up to the next ``## `` heading, trailing blanks stripped)."""
    heads = list(SECTION.finditer(text))
    sections: dict[str, str] = {}
    for i, m in enumerate(heads):
        end = heads[i + 1].start() if i + 1 < len(heads) else len(text)
        title = m[1]
        if title in sections:
            raise ValueError(f"CHANGELOG has two '## {title}' sections")
        sections[title] = text[m.end() : end].strip("\n").rstrip()
    return sections


def changelog_order_errors(text: str, where: str) -> list[str]:
    """Structure rules: only ``## Unreleased`` (first, at most once) and ``## X.Y.Z`` headings, newest first."""
    errors = []
    titles = [m[1] for m in SECTION.finditer(text)]
    versions = []
    for i, title in enumerate(titles):
        if title == UNRELEASED:
            if i != 0:
                errors.append(f"{where}: '## {UNRELEASED}' must be the first section")
            continue
        try:
            versions.append(parse_version(title))
        except ValueError:
            errors.append(f"{where}: section '## {title}' is neither '## {UNRELEASED}' nor '## X.Y.Z'")
    if versions != sorted(versions, reverse=True) or len(set(versions)) != len(versions):
        errors.append(f"{where}: version sections are not newest first without repeats")
    return errors


def sibling_requirements(pyproject_text: str) -> list[str]:
    """Every requirement string of a pyproject (dependencies, extras, dependency groups)."""
    data = tomllib.loads(pyproject_text)
    project = data.get("project", {})
    reqs = list(project.get("dependencies", []))
    for group in project.get("optional-dependencies", {}).values():
        reqs.extend(group)
    for group in data.get("dependency-groups", {}).values():
        reqs.extend(r for r in group if isinstance(r, str))
    return reqs
