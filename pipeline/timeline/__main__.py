"""Entry point of ``python -m pipeline.timeline``."""

from pipeline.timeline.cli import main

raise SystemExit(main())
