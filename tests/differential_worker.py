"""One side of the differential test: runs scenarios on whichever hot path this
process selected (``WHEELD_PURE_PYTHON``) and answers with every result and the
arena's bytes.

    python tests/differential_worker.py      (requests and answers: pickled, length-prefixed, on stdin/stdout)

A request is ``(name, shape, ops)``: a fresh shared-memory arena ``name`` of
``shape``, on which ``ops`` run in order. An op is ``(method, args)`` on the
wheel, or ``("reattach", ())``: close it and attach it again (the recovery a
restart makes). Each result is the return value in plain Python types (numpy
arrays as lists), or ``("raised", exception class name)``. After the last op,
the whole segment is read back. The arena is unlinked before the answer goes.
"""

from __future__ import annotations

import pickle
import struct
import sys

import numpy as np

from wheeld.protocol import accel
from wheeld.protocol import arena_layout as L
from wheeld.protocol.errors import WheeldError
from wheeld.shm import TimerWheel
from wheeld.shm.arena import unlink

_LEN = struct.Struct("<Q")


def _plain(value):
    if isinstance(value, np.ndarray):
        return ("array", str(value.dtype), value.tolist())
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, np.generic):
        return value.item()
    return value


def run(name: str, shape: dict, ops: list) -> dict:
    wheel = TimerWheel.create(name=name, **shape)
    results = []
    try:
        for method, args in ops:
            if method == "reattach":
                wheel.close()
                wheel = TimerWheel.attach(name)
                results.append(("reattached", wheel.repairs))
                continue
            try:
                results.append(_plain(getattr(wheel, method)(*args)))
            except WheeldError as error:
                results.append(("raised", type(error).__name__))
        results.append(("len", len(wheel), wheel.free_slots, wheel.current_ms, wheel.next_deadline()))
        results.append(("check", wheel.check()))
        arena = bytearray(wheel._seg.buf)
        arena[L.H_CREATED_WALL_MS : L.H_CREATED_WALL_MS + 8] = bytes(8)  # the wall clock at create: not the path's
    finally:
        wheel.close()
        unlink(name)
    return {"results": results, "arena": bytes(arena), "path": accel.implementation()}


def main() -> None:
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        head = stdin.read(_LEN.size)
        if len(head) < _LEN.size:
            return
        name, shape, ops = pickle.loads(stdin.read(_LEN.unpack(head)[0]))
        try:
            answer = run(name, shape, ops)
        except BaseException as error:  # an unexpected exception is an answer too (the test fails on it)
            answer = {"crashed": f"{type(error).__name__}: {error}"}
        data = pickle.dumps(answer)
        stdout.write(_LEN.pack(len(data)) + data)
        stdout.flush()


if __name__ == "__main__":
    main()
