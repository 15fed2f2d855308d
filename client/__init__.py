"""wheeld: a host-local timer service. This package is the client library.

    import wheeld
    with wheeld.connect(group="conns") as w:
        w.add("req-17", 250)          # fire in 250 ms (an armed key is re-armed)
        w.add_idle("sock-3", 30_000)  # fire after 30 s without w.touch("sock-3")
        w.cancel("req-17")            # True: this arming will not be delivered here
        for expired in w.poll(timeout_s=1.0):
            print(expired.key, expired.deadline_ms, expired.fired_ms)
"""

from wheeld.protocol.errors import (
    ArenaFull,
    BackPressure,
    BrokenPeer,
    Closed,
    CorruptArena,
    GroupLimit,
    InvalidDelay,
    InvalidKey,
    InvalidRequest,
    ProtocolError,
    RingFull,
    WheeldError,
)

from .aio import AsyncClient, connect_async
from .core import Expired
from .sync import Client, connect

__all__ = [
    "connect", "connect_async", "Client", "AsyncClient", "Expired",
    "WheeldError", "InvalidRequest", "InvalidKey", "InvalidDelay", "BackPressure", "RingFull", "ArenaFull",
    "GroupLimit", "ProtocolError", "Closed", "BrokenPeer", "CorruptArena",
]
