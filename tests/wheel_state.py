"""What a test compares between two wheels: the live records, sorted, and the checker's verdict."""

from __future__ import annotations

from wheeld.protocol import arena_layout as AL
from wheeld.shm.wheel import TimerWheel


def wheel_state(wheel: TimerWheel) -> dict:
    """Scheduled and fired records as sorted (key_meta, key, deadline, tag, aux) tuples,
    and ``wheel.check()``'s problems (none for a sound wheel)."""
    rec = wheel.records[wheel.first_entry:]
    state = rec["state"] & AL.STATE_MASK
    out = {}
    for name, code in (("scheduled", AL.SCHEDULED), ("fired", AL.FIRED)):
        live = rec[state == code]
        out[name] = sorted(zip(live["key_meta"].tolist(), live["key"].tolist(), live["deadline"].tolist(),
                               live["tag"].tolist(), live["aux"].tolist()))
    out["problems"] = wheel.check()
    return out
