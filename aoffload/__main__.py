"""``python -m aoffload``: the ``aoffload`` command line (see ``aoffload --help``)."""

from __future__ import annotations

from ._cli import main

if __name__ == "__main__":
    raise SystemExit(main())
