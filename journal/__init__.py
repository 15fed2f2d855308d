"""The journal's engine: the writer (its fsync policies, group commit, durable mark,
rotation, snapshots and compaction) in :mod:`wheeld.journal.files`, and the recovery
that rebuilds the timers from a journal directory, with its damage reports, in
:mod:`wheeld.journal.recovery`.

The format they read and write (events, lines, checks, names) is
:mod:`wheeld.protocol.journal`; every file operation goes through the port of
:mod:`wheeld.protocol.fsport`, so the simulator runs this engine on a simulated disk.
"""
