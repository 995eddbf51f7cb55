"""``python -m kittenmoe``: the ``kittenmoe`` command (demo, bench, tune)."""

from kittenmoe.cli import main

raise SystemExit(main())
