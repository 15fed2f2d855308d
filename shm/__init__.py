"""Shared-memory parts of wheeld: the arena, the timing wheel over it (with its key
index, placement rule and checker), the read-only reader ``wheelctl`` uses, client rings."""

from .wheel import DEFAULT_WHEEL_SIZE, MAX_DELAY_MS, TimerWheel, encode_ident

__all__ = ["DEFAULT_WHEEL_SIZE", "MAX_DELAY_MS", "TimerWheel", "encode_ident"]
