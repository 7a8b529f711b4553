"""``python -m fedpower_app.experiment``: the same as ``fedpower-experiment``."""

from .cli import main

raise SystemExit(main())
