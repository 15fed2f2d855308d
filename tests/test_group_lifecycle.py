"""Groups have a life cycle through the daemon: an idle group's id is reclaimed for a
new name, running out is GroupLimit with a hint, owners and quotas hold."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from daemon_harness import wait_until

import wheeld
from wheeld.ctl import main as wheelctl_main


def wheelctl(daemon, *args):
    return CliRunner().invoke(wheelctl_main, ["--socket", daemon.socket_path, "--name", daemon.name, *args],
                              catch_exceptions=False)


def test_fresh_group_names_never_run_out(daemon_factory):
    d = daemon_factory(extra=["--max-groups", "32"]).start()
    for i in range(200):  # six times the table: every name is reclaimed once its client leaves
        with wheeld.connect(d.socket_path, group=f"fresh-{i}") as w:
            w.add("k", 10_000)
            assert w.cancel("k")
            w.flush()
    doc = json.loads(wheelctl(d, "groups", "--json").stdout)
    assert doc["max"] == 32 and doc["in_use"] < 32


def test_running_out_of_group_ids_is_group_limit_with_a_hint(daemon_factory):
    d = daemon_factory(extra=["--max-groups", "8"]).start()
    clients = []
    try:
        for i in range(7):  # id 0 is "default"; 7 more names fill the table
            w = wheeld.connect(d.socket_path, group=f"busy-{i}")
            w.add("k", 600_000)
            w.flush()
            clients.append(w)
        with pytest.raises(wheeld.GroupLimit, match="--max-groups"):
            wheeld.connect(d.socket_path, group="one-too-many")
        clients.pop().close()  # "busy-6" keeps its pending timer: still in use
        with pytest.raises(wheeld.GroupLimit):
            wheeld.connect(d.socket_path, group="one-too-many")
        with wheeld.connect(d.socket_path, group="busy-5") as w:  # an existing group: fine
            assert w.cancel("k") is False  # armed by another member; the cancel still goes out
            w.flush()
        clients[5].close()  # busy-5 is now empty and memberless

        def a_group_is_free() -> bool:
            try:
                wheeld.connect(d.socket_path, group="one-too-many").close()
                return True
            except wheeld.GroupLimit:
                return False

        wait_until(a_group_is_free, 10, "busy-5's id freed once its client left", interval=0.05)
    finally:
        for w in clients:
            w.close()


def test_a_group_at_its_quota_is_refused_and_the_others_are_not(daemon_factory):
    d = daemon_factory(extra=["--group-quota", "100"]).start()
    with wheeld.connect(d.socket_path, group="greedy") as greedy, \
            wheeld.connect(d.socket_path, group="modest") as modest:
        for i in range(100):
            greedy.add(i, 600_000)
        greedy.flush()
        for i in range(50):
            greedy.add(i, 700_000)  # re-arms need no new record: allowed at the quota
        greedy.flush()

        def refused_by_the_client() -> bool:  # the daemon tells the group's members at its next publication
            try:
                greedy.add("more", 600_000)
            except wheeld.QuotaExceeded:
                return True
            with pytest.raises(wheeld.QuotaExceeded):
                greedy.flush()  # refused by the daemon if it got there first
            return False

        wait_until(refused_by_the_client, 5, "the client to refuse an add over the quota", interval=0.01)
        for i in range(100):  # another group has its own quota, untouched by greedy's
            modest.add(i, 600_000)
        modest.flush()
        assert greedy.cancel(0)
        greedy.flush()

        def accepted() -> bool:  # back under the quota: adds go through again
            try:
                greedy.add("more", 600_000)
                greedy.flush()
                return True
            except wheeld.QuotaExceeded:
                return False

        wait_until(accepted, 5, "an add accepted again under the quota", interval=0.01)
