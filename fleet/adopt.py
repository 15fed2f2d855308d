"""Takeover: a peer claims a lost host's lease, fences its stream, and adopts its timers.

``wheeld --replicate ... --adopt HOST`` (repeatable, or ``--adopt '*'`` for any host
of the fleet) runs an :class:`Adopter` beside the daemon's replicator. Every half lease
TTL it looks at the hosts it may adopt; one whose lease key is gone (lapsed: the host
did not renew it for ``--lease-ttl-s``) and whose stream holds timers is taken over:

1. **claim** the lease key with a create (a compare-and-set: of several peers, one wins),
   at the epoch after the host's last one;
2. **fence** the host's stream: a ``fence`` message that names the sequence it follows,
   so it lands after everything the host stored and nothing the host sends later is
   accepted (each of its writes names the sequence it follows, which is now the fence);
3. **read** the stream from its newest snapshot to the fence, as a journal directory,
   and recover it with the journal's own recovery (:func:`wheeld.journal.recovery.recover`);
4. **adopt**: the daemon puts the timers into its arena and journal (its
   ``adopt(host, state)``: groups of the same names, wall-clock deadlines, those past
   due at once and late) and so into its own stream;
5. **purge** the host's stream below the fence once this host's stream stored them:
   the timers are this host's now, and only the fence is left (a host that comes back
   with its old journal finds it and refuses to start: docs/fleet.md).

A peer killed between 3 and 5 leaves the host's stream whole behind the fence, and its
own lease of the host lapses: another peer adopts the host again (the timers the first
had adopted may then fire twice: the at-least-once window of a takeover).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import time
from collections.abc import Callable

import msgspec

from . import stream as S

log = logging.getLogger("wheeld.fleet")


class Adopter:
    """See the module docstring. ``adopt(host, state) -> (adopted, renamed, lost)`` is the
    daemon's (it runs in the daemon's loop)."""

    def __init__(self, config, adopt: Callable):
        self.config = config
        self.adopt = adopt
        self.adopted: dict[str, dict] = {}  # host -> what its takeover did (wheelctl fleet)

    async def run(self, replicator) -> None:
        period = max(0.25, self.config.lease_ttl_s / 2)
        while replicator.fenced is None:
            try:
                for host in await self._candidates(replicator):
                    await self._maybe_adopt(replicator, host)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("fleet: looking for hosts to adopt: %s", exc)
            await asyncio.sleep(period)

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
        if h.get(S.H_KIND) == S.FENCE:
            return  # adopted before
        epoch = int(h.get(S.H_EPOCH, "0")) + 1
        lease = S.Lease(replicator.host, epoch, replicator.pid, int(time.time() * 1000))
        try:
            await kv.create(host, msgspec.json.encode(lease))
        except Exception:
            return  # another peer claimed it first, or the host came back
        started = asyncio.get_running_loop().time()
        log.warning("fleet: host %s's lease lapsed; %s claimed it (epoch %d) and takes its timers over",
                    host, replicator.host, epoch)
        fence_seq = await self._fence(replicator, host, epoch, last.seq)
        state = await self._read(replicator, host, fence_seq)
        adopted, renamed, lost = self.adopt(host, state)
        await self._wait_replicated(replicator)
        try:
            await js.purge_stream(name, seq=fence_seq, subject=subj)
        except Exception as exc:
            log.warning("fleet: stream of %s not purged behind its fence: %s", host, exc)
        took = asyncio.get_running_loop().time() - started
        self.adopted[host] = {"epoch": epoch, "adopted": adopted, "renamed": renamed, "lost": lost,
                              "seconds": round(took, 3), "t": int(time.time() * 1000)}
        log.warning("fleet: ADOPTED host %s: %d timers (%d pending, %d fired and not acknowledged there; "
                    "%d renamed <key>@%s, %d did not fit) in %.2f s", host, adopted, len(state.pending),
                    len(state.unacked), renamed, host, lost, took)

    async def _fence(self, replicator, host: str, epoch: int, after: int) -> int:
        """The fence after the stream's last message; returns its sequence."""
        from nats.js.errors import APIError

        js, subj = replicator._js, S.subject(host)
        for _ in range(20):
            hdrs = S.headers(S.FENCE, replicator.host, epoch, 0, 0, after)
            hdrs[S.H_MSG_ID] = f"fence:{host}:{epoch}"
            try:
                ack = await js.publish(subj, b"", headers=hdrs, stream=S.stream_name(host))
                return ack.seq
            except APIError:  # the host wrote after we looked (a zombie): fence after that
                after = (await js.get_msg(S.stream_name(host), subject=subj, direct=False)).seq
        raise RuntimeError(f"could not fence the stream of host {host}")

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

    async def _wait_replicated(self, replicator, timeout_s: float = 10.0) -> None:
        """Until this host's stream stored what the adoption journaled (bounded)."""
        target = replicator.outbox.queued_lsn()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while replicator.replicated_lsn < target and loop.time() < deadline:
            await asyncio.sleep(0.01)


async def _stream_names(js):
    """Every stream's name (nats-py's streams_info, whatever the version returns)."""
    for info in await js.streams_info():
        yield info.config.name
