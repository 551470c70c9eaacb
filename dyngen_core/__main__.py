"""``python -m dyngen_core``: the same as the ``dyngen`` command."""

from __future__ import annotations

import sys

from dyngen_core.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
