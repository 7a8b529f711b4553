"""Route the ``fedpower`` logger through Flower's console handler so lines reach ``flwr run --stream``.

Also stops Flower's records from reaching the root logger: ``opacus`` calls ``logging.basicConfig``
when imported, after which every ``flwr`` record (DEBUG included) was printed a second time in
another format - a failed run showed its traceback twice. ``fedpower-run --verbose`` sets
``FEDPOWER_VERBOSE=1``: then nothing is changed on the ``flwr`` logger and ``fedpower`` logs DEBUG.
"""

from __future__ import annotations

import logging
import os


def verbose_requested() -> bool:
    return os.environ.get("FEDPOWER_VERBOSE", "").lower() in ("1", "true", "yes")


def setup_logging(level: int | None = None) -> logging.Logger:
    verbose = verbose_requested()
    if level is None:
        level = logging.DEBUG if verbose else logging.INFO
    logger = logging.getLogger("fedpower")
    logger.setLevel(level)
    flwr_logger = logging.getLogger("flwr")
    if not verbose and flwr_logger.handlers:
        flwr_logger.propagate = False  # Flower's own console handler already prints every record
    if not logger.handlers:
        flwr_handlers = flwr_logger.handlers
        if flwr_handlers:
            for handler in flwr_handlers:
                logger.addHandler(handler)
        else:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s | %(message)s", "%H:%M:%S"))
            logger.addHandler(handler)
        logger.propagate = False
    return logger
