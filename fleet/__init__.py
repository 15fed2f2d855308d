"""The fleet tier: wheeld's journal replicated to a NATS JetStream cluster, so that a
host's timers outlive the host (issue 30).

:mod:`wheeld.fleet.cluster` starts and stops a real ``nats-server`` cluster on
loopback (tests, demos, benchmarks). The fleet may import ``wheeld.journal``,
``wheeld.shm`` and ``wheeld.protocol``; the daemon may import the fleet; the fleet
never imports the daemon or the client (pyproject.toml's import contracts).
"""
