"""The fleet tier against the simulated NATS JetStream cluster (tests/sim/jetstream.py), one
scripted fault at a time: what the fleet's simulation (``python -m sim --fleet``) found,
kept as tests of the replicator and the adopter. Each runs the real Replicator (and
Adopter) on a simulated event loop; the cluster's ``script`` decides the fate of the
requests the case is about (lost before it is applied, its answer lost, or slow)."""

from __future__ import annotations

import asyncio
import random

import msgspec
import pytest

pytest.importorskip("nats")

from sim.aioloop import SimLoop, run_world  # noqa: E402
from sim.jetstream import Cluster, connector  # noqa: E402
from sim.world import World  # noqa: E402

from wheeld.fleet.replicator import FleetConfig, Replicator  # noqa: E402

MS = 1_000_000
S = 1_000_000_000


_FLEETS: list = []


@pytest.fixture(autouse=True)
def _fleets_ended():
    """After each test, every task of its fleets is cancelled and run to its end: a coroutine
    left suspended (a killed host's, or one the test stopped watching) would otherwise be
    closed by the garbage collector, where a ``finally`` that awaits raises."""
    yield
    while _FLEETS:
        _FLEETS.pop().close()


class Fleet:
    """A simulated cluster and the replicators of a few hosts, run together. Each host's
    journal is stood in for by the snapshot a replicator asks for (``want_snapshot``: at
    start, and when it must write before it delivers again), given within 10 ms."""

    def __init__(self, ttl_s: float = 2.0, timeout_s: float = 0.5):
        _FLEETS.append(self)
        self.world = World(1)
        self.cluster = Cluster(self.world, random.Random(1))
        self.ttl_s, self.timeout_s = ttl_s, timeout_s
        self.loops: list[SimLoop] = []
        self.requests: list[tuple[str, str]] = []  # (host, request) of every request sent
        self.fates: dict[tuple[str, str, int], object] = {}  # (host, request prefix, nth) -> its fate
        self.cluster.script = self._fate
        self.connections: dict[str, list] = {}  # host -> its replicator's connections
        self.loop_of: dict[str, SimLoop] = {}
        self.replicators: dict[str, Replicator] = {}

    def _fate(self, host: str, what: str):
        self.requests.append((host, what))
        for (h, prefix, nth), fate in self.fates.items():
            if h == host and what.startswith(prefix) and \
                    sum(1 for hh, w in self.requests if hh == host and w.startswith(prefix)) == nth:
                return fate
        return None

    def replicator(self, host: str, on_adopt=None, **config) -> Replicator:
        loop = SimLoop(self.world.clock_ns)
        cfg = FleetConfig(urls=("nats://sim:4222",), host_id=host, lease_ttl_s=self.ttl_s,
                          publish_timeout_s=self.timeout_s, connect_timeout_s=self.timeout_s, **config)
        replicator = Replicator(cfg, clock_ms=self.world.clock_ms, pid=100 + len(self.loops),
                                connect=connector(self.cluster, host,
                                                  on_connection=self.connections.setdefault(host, []).append))
        if on_adopt is not None:
            from wheeld.fleet.adopt import Adopter

            replicator.adopter = Adopter(cfg, on_adopt)
        self.loops.append(loop)
        self.loop_of[host] = loop
        self.replicators[host] = replicator
        loop.call(replicator.start)
        return replicator

    def _journals(self) -> None:
        for host, replicator in self.replicators.items():
            if replicator.want_snapshot and self.loop_of[host] in self.loops:
                self.loop_of[host].call(replicator.snapshotted, replicator.journal_lsn, b"")

    def kill(self, host: str) -> None:
        """SIGKILL of ``host``'s daemon: its loop never runs again, its connection is gone."""
        for conn in self.connections.get(host, ()):
            conn.dead = True
        self.loops.remove(self.loop_of[host])

    def run(self, seconds: float, check=None) -> None:
        def every_10_ms():
            self._journals()
            if check is not None:
                check()
        run_world(self.world, self.loops, self.world.now_ns + int(seconds * S), every_10_ms, every_ns=10 * MS)

    def close(self) -> None:
        """Cancel every task of every host (killed ones too) and run them to their end."""
        loops = list(self.loop_of.values())
        for loop in loops:
            for task in asyncio.all_tasks(loop):
                task.cancel()
        run_world(self.world, loops, self.world.now_ns + 5 * S, done=lambda: not any(
            asyncio.all_tasks(loop) for loop in loops))

    def nth(self, host: str, prefix: str) -> int:
        return sum(1 for h, w in self.requests if h == host and w.startswith(prefix))


def _never_past_its_key(fleet: Fleet, replicator: Replicator, seen: list):
    """A check: while the replicator says its lease may be used (valid by its clock and the
    cluster reachable), the key is there and its own."""
    def check():
        now = fleet.world.clock_ms()
        if replicator.fenced is None and replicator.lease_reachable and replicator.lease_ok(now):
            if fleet.cluster.lease_of(replicator.host) != (replicator.host, replicator.epoch):
                seen.append(now)
    return check


def test_a_renewal_taken_up_from_a_lost_answer_does_not_outlive_its_key():
    """A renewal stored whose answer was lost is found by the next one (its revision moved)
    and taken up; the lease must not then count from the later renewal's send time: the key
    lives from when the lost one was stored. Seeds 1, 196 of the fleet simulation: a host
    delivered after its key lapsed, believing its lease good for another 1.2 s."""
    fleet = Fleet(ttl_s=2.0, timeout_s=0.5)
    replicator = fleet.replicator("A")
    fleet.run(1.0)
    assert replicator.epoch == 1 and fleet.cluster.lease_of("A") == ("A", 1)
    n = fleet.nth("A", "kv write A")
    fleet.fates[("A", "kv write A", n + 1)] = "lose answer"  # stored; the host times out
    fleet.fates[("A", "kv write A", n + 3)] = 450.0  # the renewal after the take-up arrives late
    seen: list = []
    fleet.run(6.0, _never_past_its_key(fleet, replicator, seen))
    assert not seen, f"the lease was used at {seen[0]} ms though its key had lapsed"
    assert replicator.fenced is None


def test_a_lease_lookup_that_times_out_is_not_a_fence():
    """After a renewal refused for its revision, the replicator looks at the key to see who
    holds it. That lookup timing out says nothing of a holder: the host is out of reach,
    not fenced. Seeds 1, 195 of the fleet simulation: a host stood down (exit 69) with its
    lease its own and its stream unfenced, because a get of its key timed out."""
    fleet = Fleet(ttl_s=2.0, timeout_s=0.5)
    replicator = fleet.replicator("A")
    fleet.run(1.0)
    n = fleet.nth("A", "kv write A")
    fleet.fates[("A", "kv write A", n + 1)] = "lose answer"
    fleet.fates[("A", "kv get A", fleet.nth("A", "kv get A") + 1)] = "lose request"
    fleet.run(6.0)
    assert replicator.fenced is None, replicator.fenced
    assert replicator.lease_reachable and fleet.cluster.lease_of("A") == ("A", 1)
    assert replicator.lease_ok(fleet.world.clock_ms())


def test_a_refused_write_whose_tail_cannot_be_read_is_sent_again():
    """A write stored whose answer was lost is refused when sent again (its expected sequence
    is behind the stream's): the replicator reads the stream's last message to see whether
    it is its own. That read timing out stopped the replicator for good ("the replicator
    stopped"): nothing more was replicated, every flush() under replicated failed. Seeds
    194 and others of the fleet simulation."""
    fleet = Fleet(ttl_s=4.0, timeout_s=0.5)
    replicator = fleet.replicator("A")
    replicator.snapshotted(0, b"snapshot\n")
    fleet.run(1.0)
    assert replicator.replicated_lsn == 0 and replicator.state == "replicating"
    fleet.fates[("A", "publish batch 1 1", 1)] = "lose answer"
    fleet.fates[("A", "get last of wheeld.A.journal", fleet.nth("A", "get last of") + 1)] = "lose request"
    replicator.appended(1, 1, b"line 1\n")
    fleet.run(5.0)
    assert replicator.state == "replicating", replicator.state
    assert replicator.replicated_lsn == 1 and replicator.fenced is None
    stream = fleet.cluster.streams["WHEELD_A"]
    assert [m.headers["Wheeld-Lsn"] for m in stream.messages.values()] == ["0 0", "1 1"]  # stored once


def _journal(tmp_path, replicator, host: str):
    """A journal whose appends and snapshots go to ``replicator`` (as the daemon's do)."""
    from wheeld.journal.files import Journal

    journal = Journal(tmp_path / host, fsync="off", host=host, wall_ms=lambda: T0, mono_ms=lambda: 0)
    journal.tap = replicator
    journal.write_snapshot(0, [], [])
    return journal


T0 = 1_700_000_000_000


def test_a_host_cut_off_past_its_lease_does_not_take_it_back_over_a_fence(tmp_path):
    """A host cut off from the cluster past its TTL is adopted: a peer claims its key, fences
    its stream, adopts, and its claim lapses in turn. Back in reach, the host's renewal finds
    no key: it created one again, counted its lease good and delivered timers the peer had
    taken over, until a write of its own was refused. A key that lapsed is this host's again
    only if nobody fenced its stream (seeds 7, 22, 48 of the fleet simulation)."""
    from wheeld.protocol.journal import Add

    fleet = Fleet(ttl_s=2.0, timeout_s=0.5)
    a = fleet.replicator("A")
    journal = _journal(tmp_path, a, "A")
    adopted = []
    fleet.replicator("B", on_adopt=lambda host, state: adopted.append((host, state)) or (0, 0, 0), adopt=("*",))
    fleet.run(1.0)
    journal.append([Add(t=T0, g="g", k="k1", d=T0 + 60_000, s=1)])
    fleet.run(1.0)
    assert a.replicated_lsn == 1
    fleet.cluster.cut_off.add("A")
    fleet.run(4.0)
    assert adopted and adopted[0][0] == "A" and ("g", "k1") in adopted[0][1].pending
    fleet.run(2.5)  # the peer's claim of A's key lapses too
    assert fleet.cluster.lease_of("A") is None
    fleet.cluster.cut_off.discard("A")
    seen: list = []

    def check():
        now = fleet.world.clock_ms()
        if a.fenced is None and a.lease_reachable and a.lease_ok(now):
            seen.append(now)
    fleet.run(3.0, check)
    assert a.fenced is not None and "B" in a.fenced, a.fenced
    assert not seen, f"host A could deliver at {seen[0]} ms, after B adopted it"
    assert fleet.cluster.lease_of("A") is None  # not created again


@pytest.mark.parametrize("request_, fate", [("kv get A", 300.0), ("get last of wheeld.A.journal", "lose request")])
def test_a_host_back_in_reach_does_not_deliver_while_it_takes_its_lapsed_lease_back(request_, fate):
    """A host that could not reach the cluster keeps delivering (the documented window). Once
    a renewal is answered (refused: the key lapsed meanwhile), the cluster is in reach again:
    until its lease is its own again, the host must wait, as any host whose lease may have
    lapsed. It went on counting itself cut off for the round trips of the take-back (seeds
    35, 65, 79), and counted itself cut off again when one of them timed out (seeds 58, 145,
    154, 190), delivering while a peer could claim its key."""
    fleet = Fleet(ttl_s=2.0, timeout_s=0.5)
    a = fleet.replicator("A")
    fleet.run(1.0)
    fleet.cluster.cut_off.add("A")
    fleet.run(3.0)
    assert fleet.cluster.lease_of("A") is None and not a.lease_reachable
    refused: list = []
    fleet.cluster.on_note = lambda text: refused.append(text) if "kv write A" in text and "WrongLast" in text else None
    fleet.fates[("A", request_, fleet.nth("A", request_) + 1)] = fate  # a look-up of the take-back slow, or lost
    fleet.cluster.cut_off.discard("A")
    seen: list = []

    def check():
        now = fleet.world.clock_ms()
        if refused and fleet.cluster.lease_of("A") is None and a.lease_ok(now):
            seen.append(now)
    fleet.run(4.0, check)
    assert refused and fleet.cluster.lease_of("A") == ("A", 1) and a.lease_ok(fleet.world.clock_ms())
    assert not seen, f"host A could deliver at {seen[0]} ms: back in reach, its key lapsed"


def test_a_host_that_took_its_lapsed_lease_back_waits_for_a_write_of_its_own_past_a_fence_in_flight():
    """A peer claims a paused host's lapsed key and sends its fence, which the cluster stores
    only seconds later (a Raft entry committed once a quorum is back), and dies; its claim
    lapses. The host resumes, finds its key gone and its stream unfenced, and creates the
    key again. It must not deliver until a write of its own is stored in its stream: the
    fence, when it lands, would have taken the host's timers while the host, its renewals
    answered, delivered them (fleet seed 43017). Here its own write is lost twice, so the
    fence lands first: the write is refused, and the host stands down without delivering."""
    fleet = Fleet(ttl_s=2.0, timeout_s=0.5)
    h = fleet.replicator("H")
    fleet.replicator("P", on_adopt=lambda host, state: (0, 0, 0), adopt=("H",))
    fleet.run(2.5)  # both hold their leases; P for a whole TTL (it may take others over)
    fleet.fates[("P", "publish fence", 1)] = 3000.0  # stored 3 s after it is sent
    for n in (1, 2):  # H's next write (the mark it writes once it took its key back), twice
        fleet.fates[("H", "publish mark", fleet.nth("H", "publish mark") + n)] = "lose request"
    fleet.loops.remove(fleet.loop_of["H"])  # H paused
    for _ in range(800):
        fleet.run(0.01)
        if fleet.nth("P", "publish fence"):
            break
    assert fleet.nth("P", "publish fence") == 1 and fleet.cluster.lease_of("H") == ("P", 2)
    fleet.kill("P")  # the fence in flight; P's claim lapses before it lands
    fleet.run(2.2)
    assert fleet.cluster.lease_of("H") is None
    fleet.loops.append(fleet.loop_of["H"])  # H resumes
    stream = fleet.cluster.streams["WHEELD_H"]
    seen: list = []
    took_back: list = []

    def check():
        now = fleet.world.clock_ms()
        if fleet.cluster.lease_of("H") == ("H", h.epoch):
            took_back.append(now)
        fenced = any(m.headers.get("Wheeld-Kind") == "fence" for m in stream.messages.values())
        if fenced and h.fenced is None and h.lease_reachable and h.lease_ok(now):
            seen.append(now)
    fleet.run(6.0, check)
    assert took_back, "the host did not take its lapsed key back"
    assert any(m.headers.get("Wheeld-Kind") == "fence" for m in stream.messages.values())  # the fence landed
    assert not seen, f"host H could deliver at {seen[0]} ms with its stream fenced"
    assert h.fenced is not None  # its own write, refused behind the fence, told it


class Killed(BaseException):
    """The process died here (a SIGKILL in the middle of a call)."""


def test_a_takeover_that_stopped_after_its_fence_is_taken_up_by_another_peer(tmp_path):
    """A peer killed between fencing a lost host's stream and adopting its timers leaves the
    stream whole behind the fence. Another peer must adopt it: the adopters took a stream
    ending with a fence for one adopted already, and nobody ever adopted those timers (seeds
    40, 69, 71, 74, 105 of the fleet simulation: flush-acknowledged armings never delivered)."""
    from wheeld.protocol.journal import Add

    fleet = Fleet(ttl_s=2.0, timeout_s=0.5)
    a = fleet.replicator("A")
    journal = _journal(tmp_path, a, "A")
    adopted: dict[str, list] = {"B": [], "C": []}

    def adopt_as(peer):
        def adopt(host, state):
            adopted[peer].append((host, state))
            if peer == "B":
                fleet.kill("B")  # B dies before the timers are in its arena
                raise Killed()
            return len(state.pending), 0, 0
        return adopt
    fleet.replicator("B", on_adopt=adopt_as("B"), adopt=("A",))
    fleet.run(1.0)
    journal.append([Add(t=T0, g="g", k="k1", d=T0 + 60_000, s=1)])
    fleet.run(1.0)
    assert a.replicated_lsn == 1
    fleet.kill("A")  # A is lost
    fleet.run(5.0)
    assert [h for h, _ in adopted["B"]] == ["A"]  # B fenced A's stream, then died
    stream = fleet.cluster.streams["WHEELD_A"]
    assert list(stream.messages.values())[-1].headers["Wheeld-Kind"] == "fence"
    fleet.replicator("C", on_adopt=adopt_as("C"), adopt=("*",))
    fleet.run(12.0)
    hosts = [h for h, _ in adopted["C"]]  # (C, adopting any host, also takes the dead B's empty stream)
    assert hosts.count("A") == 1 and set(hosts) <= {"A", "B"}, "nobody took over what B left behind its fence"
    assert ("g", "k1") in adopted["C"][hosts.index("A")][1].pending
    kinds = [m.headers["Wheeld-Kind"] for m in stream.messages.values()]
    assert kinds == ["fence"], kinds  # purged behind C's fence, C's claim let go
    fleet.run(5.0)
    assert fleet.cluster.lease_of("A") is None and [h for h, _ in adopted["C"]].count("A") == 1


def test_hosts_that_served_through_a_cluster_outage_do_not_take_each_other_over(tmp_path):
    """Two of three servers down for longer than the lease TTL: every host keeps serving
    locally (docs/fleet.md, failure modes), and every lease lapses alike. When the quorum was
    back, each host's adopter found the other's key lapsed, claimed it and fenced it: both
    hosts stood down and nobody served their timers (seed 1527 of the fleet simulation: B
    and C fenced each other 140 ms apart). A peer now adopts only once it has held its own
    lease for a whole TTL, which leaves every host that time to take its own lease back."""
    from wheeld.protocol.journal import Add

    fleet = Fleet(ttl_s=2.0, timeout_s=0.5)
    hosts = {}
    for name in ("A", "B"):
        hosts[name] = fleet.replicator(name, on_adopt=lambda host, state: (0, 0, 0), adopt=("*",))
        journal = _journal(tmp_path, hosts[name], name)
        journal.append([Add(t=T0, g="g", k=f"{name}-1", d=T0 + 60_000, s=1)])
    fleet.run(3.0)
    assert all(r.replicated_lsn == 1 and r.fenced is None for r in hosts.values())
    fleet.cluster.crash_node(1)
    fleet.cluster.crash_node(2)
    fleet.run(5.0)
    assert fleet.cluster.lease_of("A") is None and fleet.cluster.lease_of("B") is None
    claims: list = []
    fleet.cluster.on_claim = lambda holder, host: claims.append((holder, host))
    # A's first renewal after the outage is lost: it takes its lease back a renewal late
    fleet.fates[("A", "kv write A", fleet.nth("A", "kv write A") + 1)] = "lose request"
    fleet.cluster.restart_node(1)
    fleet.cluster.restart_node(2)
    fleet.run(8.0)
    assert not claims, f"a host was taken over after the outage: {claims}"
    assert all(r.fenced is None and r.lease_ok(fleet.world.clock_ms()) for r in hosts.values())
    assert fleet.cluster.lease_of("A") == ("A", 1) and fleet.cluster.lease_of("B") == ("B", 1)


def test_a_restarted_daemon_back_in_reach_does_not_deliver_before_its_claim():
    """A daemon that starts while the cluster is out of reach serves locally (lease_reachable
    false: the documented window). Once the claim's first look-up is answered, the cluster is
    in reach: until the claim succeeds nothing may go out, since the key may be a peer's. The
    claim's failed first attempt left the host counting itself cut off through the second,
    whose look-ups were answered (seed 1808 of the fleet simulation: a restarted daemon
    delivered at epoch 0, before its claim's compare-and-set was answered)."""
    fleet = Fleet(ttl_s=2.0, timeout_s=0.5)
    first = fleet.replicator("A")
    fleet.run(1.0)
    fleet.kill("A")
    fleet.run(3.0)  # A's key lapsed: a peer takes it (and has not fenced the stream yet)
    peer = {"holder": "B", "epoch": 2, "pid": 7}
    fleet.cluster.publish("$KV.WHEELD_LEASES.A", msgspec.json.encode(peer),
                          {"Nats-Expected-Last-Subject-Sequence": "0"}, fleet.world.now_ns)
    assert fleet.cluster.lease_of("A") == ("B", 2) and first.epoch == 1
    fleet.fates[("A", "get last of wheeld.A.journal", fleet.nth("A", "get last of wheeld.A.journal") + 1)] = \
        "lose request"  # the restarted daemon's first claim fails: the cluster seems out of reach
    fleet.fates[("A", "kv get A", fleet.nth("A", "kv get A") + 1)] = 300.0
    second = fleet.replicator("A")
    seen: list = []

    def check():
        now = fleet.world.clock_ms()
        if second.lease_ok(now) and second.lease_reachable:
            seen.append(now)
        if second.lease_ok(now) and fleet.cluster.lease_of("A") == ("B", 2) and fleet.nth("A", "kv get A") > 1:
            seen.append(now)  # the look-up that names the peer was sent: the cluster was in reach
    fleet.run(4.0, check)
    assert second.fenced is not None and "B" in second.fenced, second.fenced
    assert not seen, f"the restarted daemon could deliver at {seen[0]} ms while B held its key"


def _host_lost_to_an_adopter(tmp_path, timers: int) -> tuple[Fleet, list]:
    """Host A with ``timers`` timers replicated, then killed; host B adopts A (the states it
    adopted are appended to the list returned)."""
    from wheeld.protocol.journal import Add

    fleet = Fleet(ttl_s=2.0, timeout_s=0.5)
    a = fleet.replicator("A")
    journal = _journal(tmp_path, a, "A")
    adopted: list = []
    fleet.replicator("B", on_adopt=lambda host, state: adopted.append(state) or (len(state.pending), 0, 0),
                     adopt=("A",))
    fleet.run(1.0)
    for i in range(timers):
        journal.append([Add(t=T0, g="g", k=f"k{i}", d=T0 + 60_000, s=i + 1)])
        fleet.run(0.05)
    fleet.run(1.0)
    assert a.replicated_lsn == timers
    fleet.kill("A")
    return fleet, adopted


def test_a_takeover_whose_read_outlasts_the_lease_ttl_completes(tmp_path):
    """The adopter checks that its claim of the lost host's key is still its own before it
    adopts (a claim that lapsed during the read may be another peer's by then). A read that
    took longer than the TTL (a long stream, a slow network) then always found its claim
    lapsed: the takeover started again, fenced again, read again, for ever, and the host's
    timers were never delivered (seed 3921 of the fleet simulation: 30 takeovers of one
    host, none finished). The claim is renewed while the takeover reads."""
    fleet, adopted = _host_lost_to_an_adopter(tmp_path, timers=30)
    slow = fleet.fates
    for nth in range(1, 200):
        slow[("B", "next message of WHEELD_A", nth)] = 150.0  # 30 messages: 4.5 s, past the TTL
    fleet.run(20.0)
    assert len(adopted) == 1, "the takeover never finished"
    assert len(adopted[0].pending) == 30


def test_a_renewal_that_went_unanswered_is_tried_again_soon():
    """Renewals whose requests were lost (a leader election) are tried again within a
    twentieth of the TTL, not a third: a host whose two renewals in a row fell in the
    cluster's leaderless moments let its key lapse while its peers, renewing in between,
    found the cluster fine, and a peer took it over (fleet seed 11432, [outage-takeover])."""
    fleet = Fleet(ttl_s=2.0, timeout_s=0.5)
    replicator = fleet.replicator("A")
    fleet.run(1.0)
    assert fleet.cluster.lease_of("A") == ("A", 1)
    n = fleet.nth("A", "kv write A")
    fleet.fates[("A", "kv write A", n + 1)] = "lose request"
    fleet.fates[("A", "kv write A", n + 2)] = "lose request"
    lapsed: list = []

    def check():
        if fleet.cluster.lease_of("A") != ("A", replicator.epoch):
            lapsed.append(fleet.world.clock_ms())

    fleet.run(4.0, check)
    assert fleet.nth("A", "kv write A") >= n + 3  # tried a third time, and that one was stored
    assert not lapsed, f"the key lapsed at {lapsed[0]} ms"
    assert replicator.fenced is None and replicator.epoch == 1


def test_a_fence_is_not_retried_once_the_claim_is_lost(tmp_path):
    """A peer's fence refused because the host wrote after the peer looked is tried again
    after the new tail only while the claim is still the peer's. The peer's claim had
    lapsed during its fence's timeouts; the host took its own lease back (its stream had no
    fence), wrote, and the peer's retry fenced it after those writes: the host, its lease
    valid, delivered while its stream was fenced (fleet seed 11439, [lease])."""
    import asyncio

    import msgspec

    from wheeld.fleet import stream as S
    from wheeld.fleet.adopt import Adopter, _Claim
    from wheeld.protocol.journal import Add

    fleet = Fleet(ttl_s=2.0, timeout_s=0.5)
    a = fleet.replicator("A")
    journal = _journal(tmp_path, a, "A")
    b = fleet.replicator("B")
    fleet.run(1.0)
    stream = fleet.cluster.streams["WHEELD_A"]
    looked = max(stream.messages)  # where B looked before A wrote again
    journal.append([Add(t=T0, g="g", k="k1", d=T0 + 60_000, s=1)])
    fleet.run(1.0)
    assert max(stream.messages) > looked and fleet.cluster.lease_of("A") == ("A", 1)
    value = msgspec.json.encode(S.Lease("B", 2, b.pid, T0))
    lost = _Claim(2, 1, 0, 0, value)  # a claim whose key is A's again (its revision long gone)
    adopter, result = Adopter(b.config, lambda host, state: (0, 0, 0)), []
    fleet.loop_of["B"].call(lambda: asyncio.ensure_future(adopter._fence(b, "A", lost, looked))
                            .add_done_callback(lambda f: result.append(f.result())))
    fleet.run(3.0)
    assert result == [0]  # the claim was found lost: no fence
    assert [m.headers["Wheeld-Kind"] for m in stream.messages.values()].count("fence") == 0
    assert a.fenced is None and fleet.cluster.lease_of("A") == ("A", 1)


def test_a_claim_renewal_that_went_unanswered_during_a_takeover_is_tried_again_soon(tmp_path):
    """While a takeover reads the lost host's stream, the peer renews its claim every third
    of the TTL. Two renewals in a row lost (a leader election) let the claim lapse: the
    takeover stopped short and started over with a second fence. A renewal that goes
    unanswered is now tried again within a twentieth of the TTL, as the host's own lease is
    (the class of fleet seed 11432)."""
    fleet, adopted = _host_lost_to_an_adopter(tmp_path, timers=30)
    for nth in range(1, 200):
        fleet.fates[("B", "next message of WHEELD_A", nth)] = 100.0  # 30 messages: 3 s, past the TTL
    fleet.fates[("B", "kv write A", 2)] = "lose request"  # the claim is the first; two renewals lost
    fleet.fates[("B", "kv write A", 3)] = "lose request"
    fleet.run(20.0)
    assert len(adopted) == 1 and len(adopted[0].pending) == 30
    assert fleet.nth("B", "publish fence") == 1, "the takeover stopped short and started over"


def test_a_claim_renewal_that_went_unanswered_before_the_purge_is_tried_again_soon(tmp_path):
    """After a takeover the peer renews its claim until its purge of the lost host's stream
    succeeds. Two renewals in a row lost while the purge could not be done let the claim
    lapse, and the host was adopted a second time (a second fence). As during the takeover,
    a renewal that goes unanswered is tried again within a twentieth of the TTL."""
    fleet, adopted = _host_lost_to_an_adopter(tmp_path, timers=1)
    for nth in range(1, 30):
        fleet.fates[("B", "purge WHEELD_A", nth)] = "lose request"  # the purge waits (and the claim is kept)
    fleet.run(6.0)
    assert len(adopted) == 1
    n = fleet.nth("B", "kv write A")
    fleet.fates[("B", "kv write A", n + 1)] = "lose request"
    fleet.fates[("B", "kv write A", n + 2)] = "lose request"
    fleet.run(10.0)
    assert fleet.nth("B", "kv write A") >= n + 3
    assert fleet.nth("B", "publish fence") == 1, "the claim lapsed and the host was adopted again"
    assert len(adopted) == 1
