"""The fleet tier: each host's journal replicated to a NATS JetStream cluster, host leases,
and a peer that takes over a lost host's timers (docs/fleet.md)."""
