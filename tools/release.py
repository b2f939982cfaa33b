"""Release one package of the workspace (also `nox -s release -- NAME`).

    python3 -m uv run --locked python tools/release.py release csa-kernels [--minor | --patch] [--dry-run]
    python3 -m uv run --locked python tools/release.py list
    python3 -m uv run --locked python tools/release.py tag-current

``release NAME``:
  1. refuses a dirty working tree, an empty or missing ``## Unreleased`` CHANGELOG section, an ``Unreleased`` text
     equal to a released section, and a new version that was already released (history, tag or CHANGELOG section);
  2. picks the new version: a minor bump (0.N -> 0.N+1: breaking for 0.x) when the notes contain "Breaking" or with
     ``--minor``, else a patch bump (``--patch`` refuses notes that say "Breaking");
  3. sets ``version`` in the package's pyproject and ``__version__`` in its modules, renames ``## Unreleased`` to
     ``## X.Y.Z``;
  4. breaking: every sibling that depends on NAME gets the range ``>=X.Y,<X.Y+1`` and a note in its own
     ``## Unreleased`` (it needs a release of its own; the tool lists them);
  5. ``uv lock`` (the lock records the members' versions), ``uv build --package NAME`` (wheel and sdist in dist/);
  6. commits "Release NAME X.Y.Z" (that commit records the release: ``tools/release_history.py``) and tags it
     ``NAME-vX.Y.Z`` (``--no-tag``: leave the tag to ``tag-current`` after the merge).

``tag-current`` tags each package's current version at the commit that released it (from the history), if that
version was released and the tag is missing. ``list`` prints every package's releases.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import release_history as rh

BREAKING = re.compile(r"\bbreaking\b", re.I)


class ReleaseError(ValueError):
    """A release that the tool refuses (one line: what, where, how to fix)."""


def bump(version: str, minor: bool) -> str:
    major, mnr, patch = rh.parse_version(version)
    return f"{major}.{mnr + 1}.0" if minor else f"{major}.{mnr}.{patch + 1}"


def sibling_range(version: str) -> str:
    """The range a dependant declares on a 0.x release: up to the next breaking (minor) release."""
    major, minor, _ = rh.parse_version(version)
    if major == 0:
        return f">={major}.{minor},<{major}.{minor + 1}"
    return f">={major}.{minor},<{major + 1}"


def set_version(pyproject: str, version: str) -> str:
    return rh.VERSION_LINE.sub(f'version = "{version}"', pyproject, count=1)


def set_module_version(package_dir: Path, current: str, new: str) -> list[Path]:
    """``__version__ = "<current>"`` -> ``"<new>"`` in the package's modules (its ``__init__.py``); the files changed."""
    line = f'__version__ = "{current}"'
    changed = []
    for path in sorted((package_dir / "src").rglob("*.py")):
        text = path.read_text()
        if line in text:
            path.write_text(text.replace(line, f'__version__ = "{new}"'))
            changed.append(path)
    return changed


def release_changelog(text: str, version: str) -> str:
    """``## Unreleased`` -> ``## <version>``."""
    return re.sub(rf"^## {rh.UNRELEASED}[ \t]*$", f"## {version}", text, count=1, flags=re.M)


def add_unreleased_note(text: str, note: str) -> str:
    """``note`` as a bullet at the end of the ``## Unreleased`` section (created under the title if missing)."""
    sections = rh.changelog_sections(text)
    heads = list(rh.SECTION.finditer(text))
    if rh.UNRELEASED in sections:
        end = heads[1].start() if len(heads) > 1 else len(text)
        body = text[:end].rstrip("\n")
        return f"{body}\n- {note}\n\n{text[end:].lstrip(chr(10))}"
    first = heads[0].start() if heads else len(text)
    return f"{text[:first].rstrip(chr(10))}\n\n## {rh.UNRELEASED}\n- {note}\n\n{text[first:]}"


def set_sibling_range(pyproject: str, package: str, new_range: str) -> str:
    """Replace the version range of every requirement on ``package`` (extras kept)."""
    pattern = re.compile(rf'"{re.escape(package)}(\[[^\]]*\])?(?:[<>=!~][^";]*)?"')
    return pattern.sub(lambda m: f'"{package}{m[1] or ""}{new_range}"', pyproject)


def dependants(package: str, root: Path) -> list[str]:
    """Siblings whose requirements name ``package``."""
    name = re.compile(rf"^{re.escape(package)}(\[|[<>=!~ ;]|$)")
    result = []
    for other in rh.package_names(root):
        if other == package:
            continue
        text = (root / "packages" / other / "pyproject.toml").read_text()
        if any(name.match(r) for r in rh.sibling_requirements(text)):
            result.append(other)
    return result


def uv_command() -> list[str]:
    """uv: the binary that started us (``uv run`` sets ``UV``), else the one on PATH, else ``python3 -m uv``."""
    found = os.environ.get("UV") or shutil.which("uv")
    return [found] if found else ["python3", "-m", "uv"]


def run(cmd: list[str], root: Path) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=root, check=True)


def plan_release(package: str, root: Path, minor: bool | None) -> tuple[str, str, str]:
    """(current version, new version, Unreleased text) after every refusal check."""
    if package not in rh.package_names(root):
        raise ReleaseError(f"unknown package {package!r}; packages: {', '.join(rh.package_names(root))}")
    dirty = rh.git("status", "--porcelain", "--untracked-files=no", root=root).strip()
    if dirty:
        raise ReleaseError(f"the working tree has uncommitted changes; commit or stash them first:\n{dirty}")
    changelog = root / "packages" / package / "CHANGELOG.md"
    sections = rh.changelog_sections(changelog.read_text())
    notes = sections.get(rh.UNRELEASED, "").strip()
    if not notes:
        raise ReleaseError(
            f"{changelog.relative_to(root)}: no '## {rh.UNRELEASED}' section with notes; write what changed there first"
        )
    for title, text in sections.items():
        if title != rh.UNRELEASED and text.strip() == notes:
            raise ReleaseError(
                f"{changelog.relative_to(root)}: the Unreleased notes are those of the released {title}"
            )
    breaking = bool(BREAKING.search(notes))
    if minor is False and breaking:
        raise ReleaseError(
            f"{changelog.relative_to(root)}: the notes say 'Breaking'; a patch release cannot break"
        )
    current = rh.current_version(package, root)
    released = {r.version for r in rh.releases(package, root)}
    new = bump(current, breaking if minor is None else minor)
    if current not in released:
        raise ReleaseError(
            f"{package} {current} (the pyproject's version) was never released; fix the version first"
        )
    if new in released or rh.tag_name(package, new) in rh.tags(root) or new in sections:
        raise ReleaseError(f"{package} {new} was already released (history, tag or CHANGELOG section)")
    return current, new, notes


def release(package: str, root: Path, minor: bool | None, dry_run: bool, tag: bool, build: bool) -> int:
    current, new, notes = plan_release(package, root, minor)
    breaking = rh.parse_version(new)[1] != rh.parse_version(current)[1]
    deps = dependants(package, root) if breaking else []
    print(f"release: {package} {current} -> {new} ({'breaking' if breaking else 'patch'})")
    for dep in deps:
        print(f"  dependant {dep}: range on {package} becomes '{sibling_range(new)}' (release it next)")
    if dry_run:
        return 0
    try:
        return _apply(package, new, notes, deps, root, tag, build)
    except BaseException:
        # leave nothing half-done: the files the release edits go back to the last commit
        files = [f"packages/{p}" for p in (package, *deps)] + ["uv.lock"]
        rh.git("checkout", "HEAD", "--", *files, root=root)
        print(f"release: {package} {new} failed; {', '.join(files)} restored", file=sys.stderr)
        raise


def _apply(package: str, new: str, notes: str, deps: list[str], root: Path, tag: bool, build: bool) -> int:
    pkg_dir = root / "packages" / package
    pyproject = pkg_dir / "pyproject.toml"
    current = rh.read_version(pyproject.read_text(), str(pyproject))
    pyproject.write_text(set_version(pyproject.read_text(), new))
    changelog = pkg_dir / "CHANGELOG.md"
    changelog.write_text(release_changelog(changelog.read_text(), new))
    touched = [pyproject, changelog, *set_module_version(pkg_dir, current, new)]
    for dep in deps:
        dep_dir = root / "packages" / dep
        (dep_dir / "pyproject.toml").write_text(
            set_sibling_range((dep_dir / "pyproject.toml").read_text(), package, sibling_range(new))
        )
        note = f"Needs `{package}{sibling_range(new)}` ({package} {new} is a breaking release)."
        (dep_dir / "CHANGELOG.md").write_text(
            add_unreleased_note((dep_dir / "CHANGELOG.md").read_text(), note)
        )
        touched += [dep_dir / "pyproject.toml", dep_dir / "CHANGELOG.md"]
    uv = uv_command()
    run([*uv, "lock"], root)
    touched.append(root / "uv.lock")
    if build:
        run([*uv, "build", "--package", package], root)
    run(["git", "add", *[str(p.relative_to(root)) for p in touched]], root)
    run(["git", "commit", "-q", "-m", f"Release {package} {new}\n\n{notes}"], root)
    if tag:
        run(["git", "tag", rh.tag_name(package, new)], root)
    if deps:
        print(f"release: dependants to release next: {', '.join(deps)}")
    return 0


def tag_current(root: Path) -> int:
    known = rh.tags(root)
    for package in rh.package_names(root):
        version = rh.current_version(package, root)
        found = [r for r in rh.releases(package, root) if r.version == version]
        name = rh.tag_name(package, version)
        if not found:
            print(f"{package} {version}: not released yet (no commit set this version); no tag")
        elif name in known:
            print(f"{name}: exists ({known[name][:10]})")
        else:
            rh.git("tag", name, found[0].commit, root=root)
            print(f"{name}: tagged {found[0].commit[:10]}")
    return 0


def list_releases(root: Path) -> int:
    for package in rh.package_names(root):
        rows = ", ".join(f"{r.version}@{r.commit[:7]}" for r in rh.releases(package, root))
        print(f"{package} (now {rh.current_version(package, root)}): {rows}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Release one package of the workspace.")
    parser.add_argument("--root", type=Path, default=rh.ROOT, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True)
    rel = sub.add_parser("release", help="release one package")
    rel.add_argument("package")
    kind = rel.add_mutually_exclusive_group()
    kind.add_argument(
        "--minor", dest="minor", action="store_const", const=True, help="breaking (0.x minor) release"
    )
    kind.add_argument("--patch", dest="minor", action="store_const", const=False, help="patch release")
    rel.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    rel.add_argument("--no-tag", dest="tag", action="store_false", help="commit, but do not tag")
    rel.add_argument("--no-build", dest="build", action="store_false", help="skip uv build")
    sub.add_parser("tag-current", help="tag every package's current version at its release commit")
    sub.add_parser("list", help="every package's releases")
    args = parser.parse_args(argv)
    try:
        rh.require_history(args.root)
        if args.command == "release":
            return release(args.package, args.root, args.minor, args.dry_run, args.tag, args.build)
        if args.command == "tag-current":
            return tag_current(args.root)
        return list_releases(args.root)
    except (ReleaseError, rh.HistoryMissing, ValueError) as err:
        print(f"release: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
