"""Released CHANGELOG sections never change (run by `nox -s dag`).

For every package, each release found in the git history (``tools/release_history.py``: the commit that set the
version, or its ``<name>-vX.Y.Z`` tag) must still have its ``## X.Y.Z`` section, with exactly the text it had at the
release commit. New text goes into ``## Unreleased`` (the top section) and becomes the next version's section when
``tools/release.py`` releases it. Also checked: the headings are ``## Unreleased`` / ``## X.Y.Z``, newest first, and
no section names a version that was never released other than the version the pyproject is being released at.

Releases older than ``CHECK_SINCE`` (the commit this check was introduced at) are compared with their text at that
commit: before it, released sections were edited (``python tools/check_changelogs.py --history`` lists those
edits), and those texts stand as they were then.

In a shallow clone or outside git the history is missing: the check says so and passes (``--require-history`` makes
that an error); ``git fetch --unshallow`` brings the history.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

import release_history as rh

#: main's commit when this check was introduced (issue 36); the released sections' text of that commit stands
CHECK_SINCE = "c509722"


def _is_ancestor(a: str, b: str, root: Path) -> bool:
    try:
        rh.git("merge-base", "--is-ancestor", a, b, root=root)
    except RuntimeError:
        return False
    return True


def _diff(old: str, new: str, name: str) -> str:
    lines = difflib.unified_diff(
        old.splitlines(), new.splitlines(), f"{name} (released)", f"{name} (now)", lineterm=""
    )
    return "\n".join(f"    {line}" for line in lines)


def check_package(package: str, root: Path, since: str | None) -> list[str]:
    """Errors for one package's CHANGELOG (empty list: fine)."""
    path = f"packages/{package}/CHANGELOG.md"
    file = root / path
    if not file.is_file():
        return [f"{path}: missing (every package keeps a CHANGELOG.md)"]
    text = file.read_text()
    errors = rh.changelog_order_errors(text, path)
    try:
        now = rh.changelog_sections(text)
    except ValueError as err:
        return [*errors, f"{path}: {err}"]
    since_sha = rh.git("rev-parse", f"{since}^{{commit}}", root=root).strip() if since else None
    released = rh.releases(package, root)
    for release in released:
        base = release.commit
        if since_sha is not None and _is_ancestor(release.commit, since_sha, root):
            base = since_sha
        old_text = rh.file_at(base, path, root)
        old = rh.changelog_sections(old_text).get(release.version) if old_text is not None else None
        where = f"{path} '## {release.version}' (released at {release.commit[:10]})"
        if old is None:
            if base == release.commit:
                errors.append(f"{where}: the release commit has no such section; every release needs one")
            continue
        if release.version not in now:
            errors.append(f"{where}: the section was removed; restore it as released")
        elif now[release.version] != old:
            errors.append(
                f"{where}: the released text was changed (compared with {base[:10]}); put new notes under "
                f"'## {rh.UNRELEASED}' instead and restore the section:\n"
                + _diff(old, now[release.version], release.version)
            )
    versions = {r.version for r in released}
    current = rh.current_version(package, root)
    for title in now:
        if title != rh.UNRELEASED and title not in versions and title != current:
            errors.append(
                f"{path}: '## {title}' names a version that was never released (nor is it the pyproject's "
                f"version {current}); new notes go under '## {rh.UNRELEASED}'"
            )
    return errors


def history_report(root: Path) -> None:
    """Print every released section whose text today differs from its text at the release commit."""
    for package in rh.package_names(root):
        path = f"packages/{package}/CHANGELOG.md"
        now = rh.changelog_sections((root / path).read_text())
        for release in rh.releases(package, root):
            old_text = rh.file_at(release.commit, path, root)
            old = rh.changelog_sections(old_text).get(release.version) if old_text else None
            if old is None:
                print(f"{package} {release.version}: no section at the release commit {release.commit[:10]}")
            elif old != now.get(release.version):
                print(f"{package} {release.version}: edited after its release at {release.commit[:10]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=rh.ROOT)
    parser.add_argument("--require-history", action="store_true", help="a missing git history is an error")
    parser.add_argument("--history", action="store_true", help="list released sections edited after release")
    args = parser.parse_args(argv)
    try:
        rh.require_history(args.root)
    except rh.HistoryMissing as err:
        print(f"check_changelogs: {'FAILED' if args.require_history else 'SKIPPED'}: {err}")
        return 1 if args.require_history else 0
    if args.history:
        history_report(args.root)
        return 0
    errors = [e for p in rh.package_names(args.root) for e in check_package(p, args.root, CHECK_SINCE)]
    for error in errors:
        print(error)
    packages = len(rh.package_names(args.root))
    print(f"check_changelogs: {packages} CHANGELOGs, {len(errors)} problem(s)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
