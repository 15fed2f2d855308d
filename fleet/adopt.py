"""Takeover: a peer claims a lost host's lease, fences its stream, and adopts its timers.

``wheeld --replicate ... --adopt HOST`` (repeatable, or ``--adopt '*'`` for any host
of the fleet) runs an :class:`Adopter` beside the daemon's replicator. Every half lease
TTL it looks at the hosts it may adopt; one whose lease key is gone (lapsed: the host
did not renew it for ``--lease-ttl-s``) and whose stream holds timers is taken over, if
this daemon itself has held its own lease without a break for a whole TTL
(:meth:`~wheeld.fleet.replicator.Replicator.in_reach`: when the cluster was out of
reach for everyone, every lease lapsed alike, and each host gets a TTL to take its own
back; without that, hosts that all served on through a cluster outage took each other
over, and fenced each other, as the cluster came back):

1. **claim** the lease key with a create (a compare-and-set: of several peers, one wins),
   at the epoch after the host's last one (or after the last fence's);
2. **fence** the host's stream: a ``fence`` message that names the sequence it follows,
   so it lands after everything the host stored and nothing the host sends later is
   accepted (each of its writes names the sequence it follows, which is now the fence);
3. **read** the stream from its newest snapshot to the fence, as a journal directory,
   and recover it with the journal's own recovery (:func:`wheeld.journal.recovery.recover`);
4. **adopt**, if the claim is still this peer's (renewed with a compare-and-set: it may
   have lapsed during a long read, and another peer taken over): the daemon puts the
   timers into its arena and journal (its ``adopt(host, state)``: groups of the same
   names, wall-clock deadlines, those past due at once and late) and so into its own
   stream;
5. **purge** the host's stream below the fence once this host's stream stored them:
   the timers are this host's now, and only the fence is left (a host that comes back
   with its old journal finds it and refuses to start: docs/fleet.md). Until then the
   peer keeps renewing its claim of the host's key (every third of a TTL, and a twentieth
   after a renewal that went unanswered: :func:`~wheeld.fleet.stream.renewal_retry_s`),
   so no other peer adopts the same timers again.

A takeover that stops between 2 and 5 (the peer killed, or cut off long enough for its
claim to lapse) leaves the host's stream whole behind the fence: a host whose stream ends
with a fence and still holds messages before it is adopted again, by any peer, with a
fence after that one (the timers the first had adopted may then fire twice: the
at-least-once window of a takeover). A stream that holds only its fence was adopted.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from . import stream as S

log = logging.getLogger("wheeld.fleet")


@dataclass
class _Claim:
    """A host taken over whose stream is not purged behind the fence yet."""

    epoch: int
    revision: int  # of its lease key, held (renewed) until the purge
    fence_seq: int
    lsn: int  # this daemon's journal, once it journaled the adopted timers: purged once the stream has it
    value: bytes  # the lease value written to the key


class Adopter:
    """See the module docstring. ``adopt(host, state) -> (adopted, renamed, lost)`` is the
    daemon's (it runs in the daemon's loop)."""

    def __init__(self, config, adopt: Callable):
        self.config = config
        self.adopt = adopt
        self.adopted: dict[str, dict] = {}  # host -> what its takeover did (wheelctl fleet)
        self.held: dict[str, _Claim] = {}  # hosts adopted, their streams not purged yet
        self.unanswered = False  # the last renewal of a claim held went unanswered

    async def run(self, replicator) -> None:
        loop = asyncio.get_running_loop()
        while replicator.fenced is None:
            started = loop.time()
            try:
                await self._keep_claims(replicator)
                for host in await self._candidates(replicator):
                    if host not in self.held and replicator.in_reach(replicator.clock_ms()):
                        await self._maybe_adopt(replicator, host)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("fleet: looking for hosts to adopt: %s", exc or type(exc).__name__)
            # every half TTL; every third while a claim is held (renewed here), and soon after
            # a renewal of one went unanswered; counted from this round's start, so that what
            # the round waited for (a purge or a renewal timing out) does not push the next
            # renewal past the claim's TTL
            ttl = self.config.lease_ttl_s
            period = S.renewal_retry_s(ttl) if self.unanswered else max(0.25, ttl / (3 if self.held else 2))
            await asyncio.sleep(max(0.0, period - (loop.time() - started)))

    async def _candidates(self, replicator) -> list[str]:
        wanted = set(self.config.adopt)
        if "*" in wanted:
            hosts = []
            async for name in _stream_names(replicator._js):
                if name.startswith("WHEELD_") and name != S.LEASE_BUCKET and not name.startswith("KV_"):
                    hosts.append(name[len("WHEELD_"):])
            wanted = set(hosts)
        wanted.discard(replicator.host)
        return sorted(wanted)

    async def _maybe_adopt(self, replicator, host: str) -> None:
        from nats.js.errors import KeyNotFoundError, NotFoundError

        js, kv = replicator._js, replicator._kv
        try:
            await kv.get(host)
            return  # held
        except KeyNotFoundError:
            pass
        name, subj = S.stream_name(host), S.subject(host)
        try:
            last = await js.get_msg(name, subject=subj, direct=False)
        except NotFoundError:
            return  # no stream, or nothing in it
        h = last.headers or {}
        if h.get(S.H_KIND) == S.FENCE and (await js.stream_info(name)).state.first_seq >= last.seq:
            return  # adopted before: only its fence is left
        epoch = int(h.get(S.H_EPOCH, "0")) + 1
        value = msgspec.json.encode(S.Lease(replicator.host, epoch, replicator.pid, int(time.time() * 1000)))
        try:
            revision = await kv.create(host, value)
        except Exception:
            return  # another peer claimed it first, or the host came back
        loop = asyncio.get_running_loop()
        started = loop.time()
        log.warning("fleet: host %s's lease lapsed; %s claimed it (epoch %d) and takes its timers over%s",
                    host, replicator.host, epoch, " again (a takeover stopped short)" if h.get(S.H_KIND) == S.FENCE
                    else "")
        claim = _Claim(epoch, revision, 0, 0, value)
        keeper = asyncio.ensure_future(self._hold(replicator, host, claim))  # a read may outlast the TTL
        try:
            claim.fence_seq = await self._fence(replicator, host, claim, last.seq)
            if not claim.fence_seq:
                log.warning("fleet: the claim of host %s lapsed before its stream was fenced; not adopted", host)
                return
            state = await self._read(replicator, host, claim.fence_seq)
        finally:
            keeper.cancel()
        if not await self._renew_claim(replicator, host, claim):  # raises: not known; False: lost meanwhile
            log.warning("fleet: the claim of host %s lapsed during its takeover; not adopted", host)
            return
        adopted, renamed, lost = self.adopt(host, state)
        claim.lsn = replicator.journal_lsn
        self.held[host] = claim
        took = loop.time() - started
        self.adopted[host] = {"epoch": epoch, "adopted": adopted, "renamed": renamed, "lost": lost,
                              "seconds": round(took, 3), "t": int(time.time() * 1000)}
        log.warning("fleet: ADOPTED host %s: %d timers (%d pending, %d fired and not acknowledged there; "
                    "%d renamed <key>@%s, %d did not fit) in %.2f s", host, adopted, len(state.pending),
                    len(state.unacked), renamed, host, lost, took)
        await self._keep_claims(replicator)

    async def _hold(self, replicator, host: str, claim: _Claim) -> None:
        """Renew ``claim`` every third of a TTL while a takeover fences and reads (cancelled
        after), soon again after one that went unanswered; one found lost leaves it to the
        compare-and-set before the adoption."""
        delay = self.config.lease_ttl_s / 3
        while True:
            await asyncio.sleep(delay)
            delay = self.config.lease_ttl_s / 3
            try:
                if not await self._renew_claim(replicator, host, claim):
                    return
            except asyncio.CancelledError:
                raise
            except Exception:  # out of reach: tried again soon, or the check before the adoption tells
                delay = S.renewal_retry_s(self.config.lease_ttl_s)

    async def _keep_claims(self, replicator) -> None:
        """For each host adopted and not purged yet: renew the claim of its key (a
        compare-and-set), and purge its stream behind the fence once this host's stream
        stored the adopted timers (only then are they safe from this host's loss). A claim
        found lost (it lapsed while this host was out of reach) is given up unpurged: another
        peer may be adopting the host again. :attr:`unanswered`: a renewal went unanswered."""
        self.unanswered = False
        for host, claim in list(self.held.items()):
            try:
                if not await self._renew_claim(replicator, host, claim):
                    log.warning("fleet: the claim of adopted host %s lapsed before its stream was purged; "
                                "another peer may adopt its timers again", host)
                    del self.held[host]
                    continue
            except Exception as exc:
                log.warning("fleet: the claim of adopted host %s not renewed: %s", host, exc or type(exc).__name__)
                self.unanswered = True
                continue
            if replicator.replicated_lsn < claim.lsn:
                continue
            try:
                await replicator._js.purge_stream(S.stream_name(host), seq=claim.fence_seq, subject=S.subject(host))
            except Exception as exc:
                log.warning("fleet: stream of %s not purged behind its fence yet: %s", host, exc or type(exc).__name__)
                continue
            del self.held[host]

    async def _renew_claim(self, replicator, host: str, claim: _Claim) -> bool:
        """Renew the claim of ``host``'s key (a compare-and-set on its revision): True while it
        is this peer's, False once it is not; raises when that cannot be told (a timeout)."""
        from nats.js.errors import KeyWrongLastSequenceError

        try:
            claim.revision = await replicator._kv.update(host, claim.value, last=claim.revision)
            return True
        except KeyWrongLastSequenceError:
            return await self._reclaim(replicator, host, claim)

    async def _reclaim(self, replicator, host: str, claim: _Claim) -> bool:
        """A renewal of a claim refused for its revision: still this peer's (an earlier renewal
        stored, its answer lost: renewed again on its revision)?"""
        from nats.js.errors import KeyNotFoundError

        try:
            entry = await replicator._kv.get(host)
        except KeyNotFoundError:
            return False
        lease = S.msgspec_decode_lease(entry.value) if entry.value else None
        if lease is None or lease.holder != replicator.host or lease.epoch != claim.epoch:
            return False
        claim.revision = await replicator._kv.update(host, claim.value, last=entry.revision)
        return True

    async def _fence(self, replicator, host: str, claim: _Claim, after: int) -> int:
        """The fence after the stream's last message; returns its sequence, 0 when the claim
        was found lost first. Every attempt after the first renews the claim before it (a
        compare-and-set): a fence retried once the claim had lapsed would fence a host that
        had taken its own lease back meanwhile, and written since (fleet seed 11439)."""
        from nats.js.errors import APIError

        js, subj, name, epoch = replicator._js, S.subject(host), S.stream_name(host), claim.epoch
        error: Exception | None = None
        for attempt in range(20):
            if attempt:
                try:
                    if not await self._renew_claim(replicator, host, claim):
                        return 0
                except Exception as exc:  # not known (out of reach): no fence until it is
                    error = exc
                    await asyncio.sleep(0.2)
                    continue
            hdrs = S.headers(S.FENCE, replicator.host, epoch, 0, 0, after)
            hdrs[S.H_MSG_ID] = f"fence:{host}:{epoch}"
            try:
                ack = await js.publish(subj, b"", headers=hdrs, stream=name)
                return ack.seq
            except APIError as exc:  # the host wrote after we looked (a zombie), or this fence is
                error = exc  # stored already (its acknowledgement lost): after that (its msg id answers)
                try:
                    after = (await js.get_msg(name, subject=subj, direct=False)).seq
                except Exception as lookup:
                    error = lookup
                    await asyncio.sleep(0.2)
            except Exception as exc:  # a timeout: the same fence again
                error = exc
                await asyncio.sleep(0.2)
        raise RuntimeError(f"could not fence the stream of host {host}: {error}")

    async def _read(self, replicator, host: str, fence_seq: int):
        """The host's stream, up to the fence, recovered as a journal."""
        from wheeld.journal.recovery import recover

        records = await S.read_records(replicator._js, host, fence_seq)
        kept, _fence = S.tail(records)
        directory = tempfile.mkdtemp(prefix=f"wheeld-adopt-{host}-")
        try:
            S.write_directory(kept, directory, host)
            return recover(directory, repair=False, quiet=True)
        finally:
            shutil.rmtree(directory, ignore_errors=True)


async def _stream_names(js):
    """Every stream's name (nats-py's streams_info, whatever the version returns)."""
    for info in await js.streams_info():
        yield info.config.name
