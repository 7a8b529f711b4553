"""Route the ``fedpower`` logger through Flower's console handler so lines reach ``flwr run --stream``."""

from __future__ import annotations

import logging


def setup_logging(level: int = logging.INFO) -> logging.Logger:
    logger = logging.getLogger("fedpower")
    logger.setLevel(level)
    if not logger.handlers:
        flwr_handlers = logging.getLogger("flwr").handlers
        if flwr_handlers:
            for handler in flwr_handlers:
                logger.addHandler(handler)
        else:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s | %(message)s", "%H:%M:%S"))
            logger.addHandler(handler)
        logger.propagate = False
    return logger
