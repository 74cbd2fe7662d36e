"""Entry point of ``python -m timeline``."""

from timeline.cli import main

raise SystemExit(main())
