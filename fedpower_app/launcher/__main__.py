"""``python -m fedpower_app.launcher``: the same as ``fedpower-run``."""

from .cli import main

raise SystemExit(main())
