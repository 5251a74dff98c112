"""``python -m aiospec``: the ``aiospec`` command."""

from aiospec.cli import main

raise SystemExit(main())
