import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from daemon_harness import DaemonProcess  # noqa: E402


@pytest.fixture
def daemon(tmp_path):
    """A real wheeld process on a private socket and name; killed and cleaned up after the test."""
    proc = DaemonProcess(tmp_path)
    try:
        proc.start()
        yield proc
    finally:
        proc.cleanup()


@pytest.fixture
def daemon_factory(tmp_path):
    made = []

    def make(**kwargs):
        proc = DaemonProcess(tmp_path, **kwargs)
        made.append(proc)
        return proc

    try:
        yield make
    finally:
        for proc in made:
            proc.cleanup()
