"""A cancel() that returned True is honoured: the arming is not delivered to this client,
also when its expiration comes back later from another member."""

from __future__ import annotations

from daemon_harness import wait_until

import wheeld
from wheeld.shm import reader as R


def delivered_total(name: str) -> int:
    with R.ArenaReader(name) as reader:
        return reader.counters()["delivered_total"]


def test_a_cancelled_arming_handed_back_by_another_member_is_not_delivered(daemon):
    keys = [f"k{i}" for i in range(300)]
    with wheeld.connect(daemon.socket_path, group="g") as a, wheeld.connect(daemon.socket_path, group="g") as b:
        for key in keys:
            a.add(key, 200)
        a.flush()
        a._sock.close()  # a's connection drops for a while (its ring and its bookkeeping stay)
        a._sock = None
        wait_until(lambda: delivered_total(daemon.name) >= len(keys))  # all went to b, the one member left
        assert all(a.cancel(key) for key in keys)  # a never received them: True for each
        a.flush()  # a is back; its cancels (and the internal mark after 256 of them) are applied
        b.close()  # b read none of them: they go back to the group, that is to a
        got = a.poll(1.0)
        got += a.poll(0.5)
    assert got == []
