"""Throwaway users and groups for tests that need more than one uid (root only).

``Accounts`` makes system users and groups with unique names (shadow utilities,
retried while another process holds /etc/passwd or /etc/group) and removes
every one of them in ``close()``, also after a failure. ``run_as`` runs
tests/layout_roles.py (which imports everything as root and then drops to the
identity in-process; it explains why) as one of them: ``wheeld`` itself, or
``wheelctl`` commands in-process.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROLES = Path(__file__).resolve().with_name("layout_roles.py")

#: why a test that needs throwaway users cannot run here, or None
SKIP_REASON = (
    "creates users and groups and changes identity: root only" if os.geteuid() != 0 else
    "needs the shadow utilities (groupadd, useradd, usermod, userdel, groupdel)"
    if not all(shutil.which(c) for c in ("groupadd", "useradd", "usermod", "userdel", "groupdel")) else None)


def shadow(argv: list[str]) -> None:
    """Run a shadow utility; retry while another process holds /etc/passwd or /etc/group."""
    for _ in range(50):
        result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        if result.returncode == 0:
            return
        if "lock" not in result.stderr.lower():
            break
        time.sleep(0.1)
    raise AssertionError(f"{shlex.join(argv)} failed ({result.returncode}): {result.stderr.strip()}")


def _exists(lookup, name: str) -> bool:
    try:
        lookup(name)
        return True
    except KeyError:
        return False


class Accounts:
    """Users and groups made for one test module; ``close()`` removes them all."""

    def __init__(self):
        self.tag = uuid.uuid4().hex[:6]
        self.users: list[str] = []
        self.groups: list[str] = []

    def group(self, role: str) -> int:
        name = f"wt{self.tag}-{role}"
        assert not _exists(grp.getgrnam, name), f"{name} exists already"
        self.groups.append(name)
        shadow(["groupadd", "--system", name])
        return grp.getgrnam(name).gr_gid

    def user(self, role: str, groups: list[int] = ()) -> dict:
        """A system user with its own group (and ``groups``): its identity for layout_roles.py."""
        name = f"wt{self.tag}-{role}"
        assert not _exists(pwd.getpwnam, name), f"{name} exists already"
        self.users.append(name)
        self.groups.append(name)  # --user-group
        argv = ["useradd", "--system", "--user-group", "--no-create-home", "--shell", "/usr/sbin/nologin"]
        if groups:
            argv += ["--groups", ",".join(grp.getgrgid(g).gr_name for g in groups)]
        shadow([*argv, name])
        entry = pwd.getpwnam(name)
        return {"name": name, "uid": entry.pw_uid, "gid": entry.pw_gid,
                "groups": sorted(set(os.getgrouplist(name, entry.pw_gid))), "umask": 0o022}

    def close(self) -> None:
        """Remove every user and group made here; a process still running as one of the users
        (a test that failed half-way) is killed first: userdel refuses a user in use."""
        errors = []
        for name in self.users:
            if _exists(pwd.getpwnam, name):
                _kill_processes_of(pwd.getpwnam(name).pw_uid)
                try:
                    shadow(["userdel", name])
                except AssertionError as exc:
                    errors.append(str(exc))
        for name in self.groups:
            if _exists(grp.getgrnam, name):
                try:
                    shadow(["groupdel", name])
                except AssertionError as exc:
                    errors.append(str(exc))
        left = ([n for n in self.users if _exists(pwd.getpwnam, n)]
                + [n for n in self.groups if _exists(grp.getgrnam, n)])
        assert not left, f"could not remove {left}: {errors}"


def _kill_processes_of(uid: int) -> None:
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _uid_of(entry) == uid:
            try:
                os.kill(int(entry), signal.SIGKILL)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(
            entry.isdigit() and _uid_of(entry) == uid for entry in os.listdir("/proc")):
        time.sleep(0.05)


def _uid_of(pid: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Uid:"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return None


def _env() -> dict:
    """This environment without what would point wheeld or wheelctl elsewhere (the path
    choice, WHEELD_PURE_PYTHON, stays)."""
    return {key: value for key, value in os.environ.items() if key == "WHEELD_PURE_PYTHON"
            or not key.startswith(("WHEELD_", "LISTEN_", "NOTIFY_SOCKET", "WATCHDOG_", "PYTEST_XDIST"))}


def identity(person: dict, env: dict | None = None) -> str:
    return json.dumps({key: person[key] for key in ("uid", "gid", "groups", "umask")} | {"env": env or {}})


def start_wheeld_as(person: dict, log_path: str, *args: str) -> subprocess.Popen:
    """``wheeld ARGS`` running as ``person``; its output in ``log_path``."""
    with open(log_path, "ab") as log:
        return subprocess.Popen([sys.executable, str(ROLES), identity(person), "wheeld", *args], stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=_env())


def run_wheeld_as(person: dict, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``wheeld ARGS`` as ``person`` when it is expected to exit (a refused start)."""
    return subprocess.run([sys.executable, str(ROLES), identity(person), "wheeld", *args], capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL, env=_env())


def wheelctl_as(person: dict, *commands: list[str], env: dict | None = None) -> list[dict]:
    """Each of ``commands`` (an argv list) as ``person``: exit code, stdout, stderr."""
    result = subprocess.run([sys.executable, str(ROLES), identity(person, env), "ctl", *map(json.dumps, commands)],
                            capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL, env=_env())
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["runs"]
