"""Packages whose front names load on first use (PEP 562): ``data``, ``privacy``, ``training``.

Why: importing a light submodule (the GLUE loader, the accounting package) must not import torch
through its package's front module, while ``from fedpower_app.data import client_shard`` still
works."""

from __future__ import annotations

import importlib
from typing import Callable


def forward_to(package: str, front: str, submodules: tuple[str, ...]) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``package``: a name of ``submodules`` imports that submodule; any
    other name is looked up in ``package.front``."""
    def __getattr__(name: str):
        if name in submodules:  # the import machinery asks for a submodule not imported yet
            return importlib.import_module(f"{package}.{name}")
        module = importlib.import_module(f"{package}.{front}")
        try:
            return getattr(module, name)
        except AttributeError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None

    return __getattr__
