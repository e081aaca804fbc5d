"""``python -m dgr_engine.cli`` is ``dgr``."""

from dgr_engine.cli import main

raise SystemExit(main())
