"""Shared-memory parts of wheeld: the arena, the timing wheel over it, client rings."""

from .wheel import DEFAULT_WHEEL_SIZE, MAX_DELAY_MS, TimerWheel

__all__ = ["TimerWheel", "DEFAULT_WHEEL_SIZE", "MAX_DELAY_MS"]
