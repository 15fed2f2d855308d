"""A cancel() that returned True is honoured: the arming is not delivered to this client,
also when its expiration comes back later from another member."""

from __future__ import annotations

import os

from daemon_harness import wait_until

import wheeld
from wheeld.protocol import messages as M
from wheeld.protocol.messages import decode_daemon_body
from wheeld.shm import reader as R
from wheeld.shm.ring import ClientSegment
from wheeld.shm.status import StatusPage


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


# ------------------------------------------------------------------ the client's own bookkeeping, no daemon


class _Core:
    """A ClientCore on a real ring and status page, with no daemon: the test plays the daemon."""

    def __init__(self):
        from wheeld.core import ClientCore

        class Core(ClientCore):
            def _ring_doorbell(self, urgent: bool = True) -> None:
                pass

        name = f"wheeld-test-cancel-log-{os.getpid()}-{id(self)}"
        self.consumer = ClientSegment.create(name, 1 << 14, 16)
        self.status = StatusPage.create(name + "-status")
        self.status.publish(1 << 40, 0, 0)
        self.core = Core("/nonexistent", "g", 1.0, 1.0, "")
        welcome = M.Welcome(M.PROTOCOL_VERSION, 3, name, 1 << 14, 16, "g", 1, 1 << 40, arena_epoch=7, status_page=True)
        self.core._on_welcome(welcome, [os.dup(self.consumer.fd), os.dup(self.status.readonly_fd)])

    def arm(self, key) -> int:
        """add(key); the tag of the arming, read back from the ring."""
        self.consumer.drain()
        self.core.add(key, 60_000)
        (record,) = self.consumer.drain()
        return int(record["seq"])

    def apply_marks(self) -> None:
        """The daemon applies everything: Applied for each mark pushed so far."""
        self.consumer.drain()
        for seq, _ in list(self.core._marks):
            self.core._on_message(M.Applied(seq))

    def expire(self, pairs) -> list:
        """Expirations of (key, arming tag); the keys handed to the application."""
        frame = M.Expirations([M.Expiry.for_key(key, 10, 12, seq, i, 1) for i, (key, seq) in enumerate(pairs)])
        self.core._on_message(decode_daemon_body(M.encode_daemon_message(frame)))
        return [e.key for e in self.core._take_ready()]

    def close(self):
        self.core._closed = True
        self.core._release_local()
        self.consumer.close()
        self.status.close()


def test_a_cancelled_arming_is_dropped_after_its_mark_and_after_a_rearm_was_delivered(monkeypatch):
    from wheeld import core as client_core

    monkeypatch.setattr(client_core, "_RECENT", 600)
    t = _Core()
    try:
        keys = [f"k{i}" for i in range(700)]
        tags = {key: t.arm(key) for key in keys}
        assert all(t.core.cancel(key) for key in keys)
        assert not any(t.core.cancel(key) for key in keys[:10]), "cancelled already"
        t.apply_marks()  # the ~tags of the first 512 are forgotten; the cancel log keeps them
        assert len(t.core._marks) == 0 and t.core._cancel_index is None
        late = [(key, tags[key]) for key in keys]
        assert t.expire(late) == [], "fired before the cancels were applied, handed back later"
        assert len(t.core._acks_pending) == len(keys), "each one acknowledged"
        # re-armed after its cancel, the new arming delivered: the cancelled one is still dropped
        new_tag = t.arm("k5")
        assert t.expire([("k5", new_tag)]) == ["k5"]
        assert t.expire([("k5", tags["k5"])]) == []
        # another arming of ours that was never cancelled nor handed over is delivered
        other = t.arm("fresh")
        assert t.expire([("fresh", other)]) == ["fresh"]
        # at least the latest _RECENT cancels are kept; the oldest ones go a mark's list at a time
        more = [f"m{i}" for i in range(1100)]
        more_tags = {key: t.arm(key) for key in more}
        assert all(t.core.cancel(key) for key in more)
        t.apply_marks()
        assert t.expire([(key, more_tags[key]) for key in more[-600:]]) == []
        assert t.expire([(key, tags[key]) for key in keys[:100]]) == keys[:100], "forgotten: the log moved on"
        assert t.core._cancel_log_pairs >= 600 and sum(t.core._cancel_index.values()) == t.core._cancel_log_pairs \
            + len(t.core._cancelled_since_mark) // 2
    finally:
        t.close()


def test_the_cancel_index_goes_when_unasked_for_a_whole_log_and_comes_back_when_needed(monkeypatch):
    from wheeld import core as client_core

    monkeypatch.setattr(client_core, "_RECENT", 512)
    t = _Core()
    try:
        first = [f"a{i}" for i in range(256)]
        tags = {key: t.arm(key) for key in first}
        assert all(t.core.cancel(key) for key in first)
        t.apply_marks()
        assert t.expire([(first[0], tags[first[0]])]) == []
        assert t.core._cancel_index is not None
        for round_ in range(4):  # marks go by, nobody asks
            keys = [f"r{round_}-{i}" for i in range(256)]
            for key in keys:
                t.arm(key)
            assert all(t.core.cancel(key) for key in keys)
        assert t.core._cancel_index is None
        last = [f"z{i}" for i in range(256)]
        last_tags = {key: t.arm(key) for key in last}
        assert all(t.core.cancel(key) for key in last)
        t.apply_marks()
        assert t.expire([(key, last_tags[key]) for key in last]) == []
    finally:
        t.close()


def test_keys_of_each_type_are_tracked_apart_and_equal_keys_of_other_classes_together():
    import enum

    class Label(str):
        pass

    class Code(enum.IntEnum):
        FIVE = 5

    t = _Core()
    try:
        tags = {repr(key): t.arm(key) for key in ("5", 5, b"5")}
        assert t.core.cancel(b"5") and not t.core.cancel(bytearray(b"5")), "bytes-like: one key"
        assert t.core.cancel(Code.FIVE) and not t.core.cancel(5), "an int subclass is its int"
        assert t.core.cancel(Label("5")) and not t.core.cancel("5"), "a str subclass is its str"
        t.apply_marks()
        assert t.expire([("5", tags["'5'"]), (5, tags["5"]), (b"5", tags["b'5'"])]) == []
        again = {repr(key): t.arm(key) for key in (Label("x"), Code.FIVE, bytearray(b"x"))}
        assert t.expire([(5, again["<Code.FIVE: 5>"]), ("x", again["'x'"]), (b"x", again["bytearray(b'x')"])]) \
            == [5, "x", b"x"]
        assert not t.core.cancel("x") and not t.core.cancel(5) and not t.core.cancel(b"x"), "delivered already"
    finally:
        t.close()
