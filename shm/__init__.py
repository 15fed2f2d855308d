"""Shared-memory parts of wheeld: the arena, the timing wheel over it (with its key
index, placement rule and checker), the read-only reader ``wheelctl`` uses, client rings.

The wheel's names below are loaded on first use (PEP 562): a client imports
``wheeld.shm.ring`` and ``wheeld.shm.status`` through this package, and must not load
the wheel, its key index, placement and checker for it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__all__ = ["DEFAULT_WHEEL_SIZE", "MAX_DELAY_MS", "TimerWheel", "encode_ident"]

if TYPE_CHECKING:
    from .wheel import DEFAULT_WHEEL_SIZE, MAX_DELAY_MS, TimerWheel, encode_ident


def __getattr__(name: str):
    if name in __all__:
        value = getattr(importlib.import_module(".wheel", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
