"""The fleet tier: each host's journal replicated to a NATS JetStream cluster, host
leases, and a peer that takes over a lost host's timers (docs/fleet.md).

:mod:`wheeld.fleet.stream` (names, headers, a stream read back as a journal),
:mod:`wheeld.fleet.replicator` (the host's side), :mod:`wheeld.fleet.adopt` (the
takeover), and :mod:`wheeld.fleet.cluster`, which starts and stops a real
``nats-server`` cluster on loopback (tests, the demo, benchmarks). The fleet may import
``wheeld.journal``, ``wheeld.shm`` and ``wheeld.protocol``; the daemon may import the
fleet; the fleet never imports the daemon or the client (pyproject.toml's import
contracts).
"""
