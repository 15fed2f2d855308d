"""wheeld: a host-local timer service. This package is the client library.

    import wheeld
    with wheeld.connect(group="conns") as w:
        w.add("req-17", 250)          # fire in 250 ms (an armed key is re-armed)
        w.add_idle("sock-3", 30_000)  # fire after 30 s without w.touch("sock-3")
        w.cancel("req-17")            # True: this arming will not be delivered here
        for expired in w.poll(timeout_s=1.0):
            print(expired.key, expired.deadline_ms, expired.fired_ms)

The names below are loaded on first use (PEP 562): ``wheeld`` is also the root
of ``wheeld.daemon``, ``wheeld.shm``, ``wheeld.protocol`` and ``wheeld.pipeline``,
and importing one of those must not load the client (nor posix_ipc and numpy).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from wheeld.protocol import accel as _accel

# The compiled or the Python hot path (WHEELD_PURE_PYTHON): decided here, before any
# of wheeld's subpackages is imported, since they are all imported through this package.
_accel.install_finder()

_ERRORS = "wheeld.protocol.errors"

#: public name -> the module that defines it
_EXPORTS = {
    "connect": "wheeld.sync",
    "Client": "wheeld.sync",
    "connect_async": "wheeld.aio",
    "AsyncClient": "wheeld.aio",
    "Expired": "wheeld.core",
    **dict.fromkeys(
        (
            "WheeldError", "InvalidRequest", "InvalidKey", "InvalidDelay", "BackPressure", "RingFull", "ArenaFull",
            "QuotaExceeded", "GroupLimit", "Timeout", "ProtocolError", "NotAllowed", "Closed", "ForkedClient",
            "BrokenPeer", "DaemonNotRunning", "CorruptArena", "JournalUnavailable", "ReplicationBehind",
        ),
        _ERRORS,
    ),
}  # fmt: skip

__all__ = list(_EXPORTS)

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ loads these
    from wheeld.protocol.errors import (
        ArenaFull,
        BackPressure,
        BrokenPeer,
        Closed,
        CorruptArena,
        DaemonNotRunning,
        ForkedClient,
        GroupLimit,
        InvalidDelay,
        InvalidKey,
        InvalidRequest,
        JournalUnavailable,
        NotAllowed,
        ProtocolError,
        QuotaExceeded,
        ReplicationBehind,
        RingFull,
        Timeout,
        WheeldError,
    )

    from .aio import AsyncClient, connect_async
    from .core import Expired
    from .sync import Client, connect


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'wheeld' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup does not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
