"""The tests' name for :mod:`wheeld.testing` (the harness that starts real daemons)."""

from wheeld.testing import (  # noqa: F401 - re-exported for the tests
    DaemonProcess,
    accepts,
    child_pids,
    mono_ms,
    process_state,
    unique_name,
    unlink_segments,
    wait_for_clock,
    wait_until,
    wait_until_async,
)
