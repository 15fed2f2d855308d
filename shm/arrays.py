"""Small numpy helpers shared by the wheel's batch paths and its key index."""

from __future__ import annotations

import numpy as np


def run_starts(values: np.ndarray) -> np.ndarray:
    """Indices where a run of equal values starts (the first is 0); ``values`` non-empty."""
    change = np.empty(values.size, dtype=bool)
    change[0] = True
    np.not_equal(values[1:], values[:-1], out=change[1:])
    return np.flatnonzero(change)


def has_duplicates(values: np.ndarray) -> bool:
    ordered = np.sort(values)
    return bool((ordered[1:] == ordered[:-1]).any())


def first_of_each(values: np.ndarray) -> np.ndarray:
    """Indices of the first occurrence of each distinct value (np.unique is slow on small arrays)."""
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    head = np.ones(values.size, dtype=bool)
    head[1:] = ordered[1:] != ordered[:-1]
    return order[head]
