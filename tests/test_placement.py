"""The placement rule (shm/placement.py): the scalar and the vectorized form agree, and a
placed deadline lands where the rule says (never early, within its level's reach)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from wheeld.protocol import arena_layout as L
from wheeld.shm.placement import Placement

geometry_st = st.tuples(st.sampled_from([1, 2, 3, 10]), st.sampled_from([2, 4, 16, 256]), st.integers(1, 5))


@settings(max_examples=300, deadline=None)
@given(geometry=geometry_st, clock=st.integers(-(1 << 40), 1 << 40),
       offsets=st.lists(st.integers(-(1 << 42), 1 << 42) | st.integers(-300, 70_000), min_size=1, max_size=40))
def test_bucket_for_and_buckets_for_agree(geometry, clock, offsets):
    tick_ms, wheel_size, levels = geometry
    p = Placement(tick_ms, wheel_size, levels)
    deadlines = np.array([clock + o for o in offsets], dtype=np.int64)
    buckets, expirations, placed_levels = p.buckets_for(deadlines, clock)
    for j, d in enumerate(deadlines.tolist()):
        b, expiration, level = p.bucket_for(d, clock)
        assert (b, expiration, level) == (buckets[j], expirations[j], placed_levels[j])
        if d <= clock:
            assert (b, expiration, level) == (p.due_list, clock, L.DUE_LEVEL)
            continue
        tick = p.ticks[level]
        assert b == level * wheel_size + (expiration // tick) % wheel_size
        assert clock < expiration and expiration % tick == 0
        v, fits = p.level_value(expiration, clock, level)
        assert fits and v * tick == expiration
        if not p.level_value(d, clock, level)[1]:
            assert level == levels - 1 and expiration <= d  # beyond the top level: its farthest bucket
        elif level == 0:
            assert d <= expiration < d + tick  # rounded up: never early, at most a tick late
        else:
            assert expiration <= d < expiration + tick  # the bucket cascades before d
        for lower in range(level):
            assert not p.level_value(d, clock, lower)[1]  # the lowest level that reaches it
