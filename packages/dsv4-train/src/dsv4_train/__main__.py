"""``python -m dsv4_train`` and the ``dsv4`` console script: the warning filters first, then the command."""

from __future__ import annotations

import sys

from dsv4_train.quiet import quiet_known_warnings


def main(argv: list[str] | None = None) -> int:
    """The ``dsv4`` command (:func:`dsv4_train.cli.main`) with megatron-core's import-time warnings filtered."""
    quiet_known_warnings()
    # imported after the filters (an ordering constraint, not an optional dependency): megatron-core warns while
    # it is imported
    from dsv4_train.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
