"""The installed layout, played for real with throwaway users (root only).

What systemd would do is done here by hand, from the shipped files:

* users and groups: the ``groupadd``/``useradd``/``usermod`` commands of
  docs/operating.md's "Install" section (the variant without systemd-sysusers)
  are *executed*, with the documented names replaced by unique throwaway ones;
  a wrong command in the guide fails this test. ``myworker`` stands for each of
  two worker users, ``myoperator`` for the operator; an outsider gets no command.
* /run/wheeld and /var/lib/wheeld: stand-ins under a temporary directory with the
  owner and mode of systemd/wheeld.tmpfiles and ``StateDirectoryMode=``;
* the socket: bound by the test with wheeld.socket's owner, group and mode and
  handed to the daemon as fd 3 with ``LISTEN_FDS=1``, ``LISTEN_PID``,
  ``LISTEN_FDNAMES=wheeld``;
* the daemon: the service's ``ExecStart=`` options (names and paths mapped),
  ``User=``, ``Group=``, ``SupplementaryGroups=``, ``UMask=``, and a private /proc
  mounted with what ``ProtectProc=``/``ProcSubset=`` mean.

Clients and wheelctl run as the throwaway users through tests/layout_roles.py
(which explains why it changes identity in-process) and find the socket by the
library's default lookup, with /run/wheeld replaced by its stand-in.

Every user, group, process, directory and segment made here is removed
afterwards, also when a check fails.
"""

from __future__ import annotations

import contextlib
import grp
import json
import os
import pwd
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from daemon_harness import unique_name, unlink_segments, wait_until

REPO = Path(__file__).resolve().parent.parent
GUIDE = REPO / "docs" / "operating.md"
SERVICE = REPO / "systemd" / "wheeld.service"
SOCKET_UNIT = REPO / "systemd" / "wheeld.socket"
TMPFILES = REPO / "systemd" / "wheeld.tmpfiles"
SYSUSERS = REPO / "systemd" / "sysusers.conf"
ROLES = Path(__file__).resolve().with_name("layout_roles.py")

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="creates system users and groups and changes identity: root only"),
    pytest.mark.skipif(not all(shutil.which(c) for c in ("groupadd", "useradd", "usermod", "userdel", "groupdel")),
                       reason="needs the shadow utilities (groupadd, useradd, usermod, userdel, groupdel)"),
]

SHADOW_COMMANDS = ("groupadd", "useradd", "usermod")


# ----------------------------------------------------------------- the shipped files
def unit_values(path: Path) -> dict[str, list[str]]:
    """``key -> [values]`` of a unit file (every section; keys repeat)."""
    found: dict[str, list[str]] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            found.setdefault(key.strip(), []).append(value.strip())
    return found


def one(values: dict[str, list[str]], key: str) -> str:
    assert len(values.get(key, [])) == 1, f"expected exactly one {key}= in the unit, found {values.get(key)}"
    return values[key][0]


def guide_install_commands() -> list[list[str]]:
    """The groupadd/useradd/usermod commands of the guide's Install section, in order, as argv lists."""
    text = GUIDE.read_text()
    section = text.split("\n## Install\n", 1)[1].split("\n## ", 1)[0]
    commands = []
    for block in re.findall(r"```sh\n(.*?)```", section, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if argv and argv[0] in SHADOW_COMMANDS:
                commands.append(argv)
    return commands


def substitute(argv: list[str], names: dict[str, str]) -> list[str]:
    """Replace documented names by throwaway ones: whole arguments, or items of a comma list."""
    out = []
    for arg in argv:
        parts = arg.split(",")
        if all(part in names for part in parts):
            arg = ",".join(names[part] for part in parts)
        out.append(arg)
    return out


# ----------------------------------------------------------------- users and groups
def shadow(argv: list[str]) -> None:
    """Run a shadow utility; retry while another process holds /etc/passwd or /etc/group."""
    for _ in range(50):
        result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        if result.returncode == 0:
            return
        if "lock" not in result.stderr.lower():
            break
        time.sleep(0.1)  # another process holds the lock: try again
    raise AssertionError(f"{shlex.join(argv)} failed ({result.returncode}): {result.stderr.strip()}")


def user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


def group_exists(name: str) -> bool:
    try:
        grp.getgrnam(name)
        return True
    except KeyError:
        return False


class Identity:
    """A throwaway user as a process of theirs would be: uid, primary gid, all groups."""

    def __init__(self, name: str):
        entry = pwd.getpwnam(name)
        self.name, self.uid, self.gid = name, entry.pw_uid, entry.pw_gid
        self.groups = sorted(set(os.getgrouplist(name, entry.pw_gid)))

    def group_names(self) -> set[str]:
        return {grp.getgrgid(g).gr_name for g in self.groups}


@pytest.fixture(scope="module")
def people():
    """The unit's users and groups made by the guide's commands, plus workers, an operator, an outsider."""
    tag = uuid.uuid4().hex[:6]
    names = {"wheeld": f"wl{tag}-d", "wheeld-clients": f"wl{tag}-cl", "wheeld-monitor": f"wl{tag}-mon"}
    site_users = {"worker_a": f"wl{tag}-wa", "worker_b": f"wl{tag}-wb", "operator": f"wl{tag}-op",
                  "outsider": f"wl{tag}-out"}
    every_user = [names["wheeld"], *site_users.values()]
    every_group = [names["wheeld-clients"], names["wheeld-monitor"], *every_user]  # and the users' own groups
    for name in every_user + every_group:
        assert not user_exists(name) and not group_exists(name), f"{name} exists already"
    commands = guide_install_commands()
    documented = {(argv[0], name) for argv in commands for name in argv[1:]
                  if name in (*names, "myworker", "myoperator")}
    for needed in [("groupadd", "wheeld-clients"), ("groupadd", "wheeld-monitor"), ("useradd", "wheeld"),
                   ("usermod", "myworker"), ("usermod", "myoperator")]:
        assert needed in documented, f"docs/operating.md's Install section has no {needed[0]} ... {needed[1]}"
    try:
        for name in site_users.values():  # the site's own users, made as a site would
            shadow(["useradd", "--system", "--user-group", "--no-create-home", "--shell", "/usr/sbin/nologin", name])
        for argv in commands:
            if "myworker" in argv:
                for worker in (site_users["worker_a"], site_users["worker_b"]):
                    shadow(substitute(argv, {**names, "myworker": worker}))
            else:
                shadow(substitute(argv, {**names, "myoperator": site_users["operator"]}))
        ids = {role: Identity(name) for role, name in site_users.items()}
        ids["daemon"] = Identity(names["wheeld"])
        gids = {key: grp.getgrnam(value).gr_gid for key, value in names.items() if key != "wheeld"}
        yield {"names": names, "ids": ids, "clients_gid": gids["wheeld-clients"],
               "monitor_gid": gids["wheeld-monitor"]}
    finally:
        for name in every_user:
            if user_exists(name):
                with contextlib.suppress(AssertionError):
                    shadow(["userdel", name])
        for name in every_group:
            if group_exists(name):
                with contextlib.suppress(AssertionError):
                    shadow(["groupdel", name])
        left = [n for n in every_user if user_exists(n)] + [n for n in every_group if group_exists(n)]
        assert not left, f"could not remove {left}"


def test_the_guides_commands_give_each_identity_the_groups_the_model_says(people):
    """The daemon is in the monitoring group and not in the clients group; workers only in
    the clients group; the operator in both; the outsider in neither; and the commands
    agree with what sysusers.conf makes."""
    n, ids = people["names"], people["ids"]
    clients, monitor = n["wheeld-clients"], n["wheeld-monitor"]
    daemon = ids["daemon"]
    assert daemon.uid < 1000 and pwd.getpwnam(daemon.name).pw_shell.endswith("nologin")
    assert grp.getgrgid(daemon.gid).gr_name == daemon.name  # --user-group: Group=wheeld exists
    assert daemon.group_names() == {daemon.name, monitor}
    assert {clients, monitor} & ids["worker_a"].group_names() == {clients}
    assert {clients, monitor} & ids["worker_b"].group_names() == {clients}
    assert {clients, monitor} <= ids["operator"].group_names()
    assert not {clients, monitor} & ids["outsider"].group_names()
    if shutil.which("systemd-sysusers"):
        with tempfile.TemporaryDirectory() as root:
            os.mkdir(os.path.join(root, "etc"))
            subprocess.run(["systemd-sysusers", f"--root={root}", str(SYSUSERS)], check=True, capture_output=True,
                           timeout=60)
            members = {line.split(":")[0]: line.strip().split(":")[3] for line in open(os.path.join(root, "etc/group"))}
        assert members.get("wheeld-clients") == "" and members.get("wheeld-monitor") == "wheeld"


# ----------------------------------------------------------------- the layout
class Layout:
    """Directories, socket and daemon of one run; ``close()`` undoes all of it."""

    def __init__(self, people, *, daemon_as_root: bool):
        self.people = people
        self.ids = people["ids"]
        self.names = people["names"]
        self.as_root = daemon_as_root
        self.name = unique_name()
        self.procs: list[subprocess.Popen] = []
        self.base = tempfile.mkdtemp(prefix="wheeld-layout-")
        os.chmod(self.base, 0o755)
        self.service = unit_values(SERVICE)
        self.socket_unit = unit_values(SOCKET_UNIT)
        self.daemon: subprocess.Popen | None = None
        self.log_path = os.path.join(self.base, "wheeld.log")
        self.listener: socket.socket | None = None

    # -- what the shipped files say, mapped onto this run
    def owner(self, user: str, group: str) -> tuple[int, int]:
        if self.as_root:
            return 0, 0
        mapping = {"wheeld": self.ids["daemon"], "root": None}
        user_id = mapping[user]
        uid = 0 if user_id is None else user_id.uid
        gid = 0 if group == "root" else grp.getgrnam(self.map_name(group)).gr_gid
        return uid, gid

    def map_name(self, name: str) -> str:
        return self.names.get(name, name)

    def make_directories(self) -> None:
        (_kind, path, mode, user, group, _age), = [line.split() for line in TMPFILES.read_text().splitlines()
                                                   if line.startswith("d ")]
        assert path == "/run/wheeld"
        self.run_dir = os.path.join(self.base, "run", "wheeld")
        os.makedirs(self.run_dir)
        os.chmod(os.path.dirname(self.run_dir), 0o755)
        os.chown(self.run_dir, *self.owner(user, group))
        os.chmod(self.run_dir, int(mode, 8))
        state = one(self.service, "StateDirectory")
        self.state_dir = os.path.join(self.base, "lib", state)
        os.makedirs(self.state_dir)
        os.chmod(os.path.dirname(self.state_dir), 0o755)
        os.chown(self.state_dir, *self.owner(one(self.service, "User"), one(self.service, "Group")))
        os.chmod(self.state_dir, int(one(self.service, "StateDirectoryMode"), 8))
        self.socket_path = os.path.join(self.run_dir, f"{self.name}.sock")

    def map_path(self, path: str) -> str:
        if path == one(self.socket_unit, "ListenStream"):
            return self.socket_path
        if path.startswith("/var/lib/"):
            return os.path.join(os.path.dirname(self.state_dir), path[len("/var/lib/"):])
        raise AssertionError(f"the service names a path this test does not know how to map: {path}")

    def bind_socket(self) -> None:
        listen = one(self.socket_unit, "ListenStream")
        assert listen == os.path.join("/run/wheeld", "default.sock")  # the library's default for instance 'default'
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(self.socket_path)
        user, group = one(self.socket_unit, "SocketUser"), one(self.socket_unit, "SocketGroup")
        os.chown(self.socket_path, 0 if user == "root" else pwd.getpwnam(self.map_name(user)).pw_uid,
                 grp.getgrnam(self.map_name(group)).gr_gid)
        os.chmod(self.socket_path, int(one(self.socket_unit, "SocketMode"), 8))
        sock.listen(int(one(self.socket_unit, "Backlog")))
        self.listener = sock

    def daemon_command(self) -> list[str]:
        argv = shlex.split(one(self.service, "ExecStart"))
        assert argv[0] == "/usr/local/bin/wheeld"
        args = []
        rest = iter(argv[1:])
        for arg in rest:
            if arg == "--monitor-group" and self.as_root:
                next(rest)  # a root daemon without a monitoring group: arena 0600
                continue
            if arg.startswith("/"):
                arg = self.map_path(arg)
            args.append(self.map_name(arg))
        return [*args, "--name", self.name, "--capacity", "20000"]

    def proc_options(self) -> str:
        options = []
        protect = self.service.get("ProtectProc", ["default"])[-1]
        if protect != "default":
            options.append(f"hidepid={protect}")
        if self.service.get("ProcSubset", ["all"])[-1] == "pid":
            options.append("subset=pid")
        return ",".join(options)

    def daemon_identity(self) -> dict:
        umask = int(one(self.service, "UMask"), 8)
        env = {key: value for key, value in (item.split("=", 1) for item in self.service.get("Environment", []))}
        identity = {"umask": umask, "listen_fd": self.listener.fileno(), "proc": self.proc_options(), "env": env}
        if self.as_root:
            return {**identity, "uid": 0, "gid": 0, "groups": []}
        daemon = self.ids["daemon"]
        assert one(self.service, "User") == "wheeld" and one(self.service, "Group") == "wheeld"
        supplementary = [grp.getgrnam(self.map_name(g)).gr_gid
                         for g in " ".join(self.service.get("SupplementaryGroups", [])).split()]
        return {**identity, "uid": daemon.uid, "gid": daemon.gid,
                "groups": sorted(set(daemon.groups) | set(supplementary))}

    # -- processes
    def _env(self) -> dict:
        return {key: value for key, value in os.environ.items()
                if not key.startswith(("WHEELD_", "LISTEN_", "NOTIFY_SOCKET", "PYTEST_XDIST"))}

    def start_daemon(self) -> None:
        self.make_directories()
        self.bind_socket()
        identity = self.daemon_as = self.daemon_identity()
        with open(self.log_path, "wb") as log:
            self.daemon = subprocess.Popen(
                [sys.executable, str(ROLES), json.dumps(identity), "wheeld", *self.daemon_command()],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, pass_fds=[self.listener.fileno()],
                env=self._env())
        self.procs.append(self.daemon)
        self.listener.close()  # the daemon has it now, as with systemd... which keeps its own copy;
        self.listener = None   # here nothing else listens, so a dead daemon shows as ECONNREFUSED

        def ready() -> bool:
            if self.daemon.poll() is not None:
                raise AssertionError(f"wheeld exited with {self.daemon.poll()}:\n{self.log()}")
            return " ready on " in self.log()

        wait_until(ready, 20, "the installed wheeld to log that it is ready", interval=0.02, detail=self.log)

    def log(self) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def identity(self, role: str) -> dict:
        person = self.ids[role]
        return {"uid": person.uid, "gid": person.gid, "groups": person.groups, "umask": 0o022,
                "system_socket_dir": self.run_dir, "env": {"WHEELD_NAME": self.name}}

    def start_as(self, role: str, what: str, *args: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, str(ROLES), json.dumps(self.identity(role)), what, *args],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=self._env())
        self.procs.append(proc)
        return proc

    @staticmethod
    def finish(proc: subprocess.Popen, timeout: float = 30) -> tuple[int, str, str]:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(10)
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
        if self.listener is not None:
            self.listener.close()
        unlink_segments(self.name)
        shutil.rmtree(self.base, ignore_errors=True)


@pytest.fixture
def layout_factory(people):
    made = []

    def make(**kwargs) -> Layout:
        layout = Layout(people, **kwargs)
        made.append(layout)
        return layout

    try:
        yield make
    finally:
        for layout in made:
            layout.close()


# ----------------------------------------------------------------- checks
def one_line_error(run: dict, expected_code: int, *fragments: str) -> None:
    """wheelctl failed cleanly: the exit code, one line on stderr, no traceback."""
    lines = run["err"].strip().splitlines()
    assert run["code"] == expected_code, f"wheelctl {run['args']}: exit {run['code']}, stderr:\n{run['err']}"
    assert len(lines) == 1 and lines[0].startswith("wheelctl: "), (
        f"wheelctl {run['args']}: not one clean line:\n{run['err']}")
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def shm_mode(name: str, segment: str) -> tuple[int, int, int]:
    st = os.stat(f"/dev/shm/wheeld-{name}-{segment}")
    return st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)


def got_all(report: dict, expected: int) -> None:
    assert (report["received"], report["duplicates"], report["early"], report["foreign"]) == (expected, 0, 0, 0), report


def check_isolation(layout: Layout, *, monitors: bool) -> None:
    """Everything both tests check: workers work and cannot reach each other or the daemon's
    files, the operator reads the figures (with a monitoring group), outsiders get nothing."""
    ids, name = layout.ids, layout.name
    a_group = f"ga-{uuid.uuid4().hex[:6]}"
    journal = os.path.join(layout.state_dir, "journal")

    # worker A keeps adding, flushing and receiving in its own group while everything below happens
    holder = layout.start_as("worker_a", "holder", a_group)
    outsider = layout.start_as("outsider", "outsider", "g-out", layout.state_dir, journal)
    operator = layout.start_as("operator", "ctl",
                               *map(json.dumps, (["stats", "--interval", "0"], ["groups"], ["check"])))
    line = holder.stdout.readline()
    assert line, f"worker A did not start: {holder.stderr.read() if holder.poll() is not None else ''}"
    a = json.loads(line)
    assert a["socket_path"] == layout.socket_path  # found by the library's default lookup
    probe = layout.start_as("worker_a", "probe", str(a["pid"]), str(a["ring_fd"]), layout.state_dir, journal)
    attacker = layout.start_as("worker_b", "attacker", name, str(a["pid"]), str(a["ring_fd"]), str(layout.daemon.pid),
                               a_group)

    # the same uid may look into A's descriptors (what B meets below is the uid rule), but even
    # it cannot open the ring through them: the memfd is 0600 and belongs to the daemon's uid
    code, out, err = layout.finish(probe)
    assert code == 0, err
    report = json.loads(out)
    assert {item["what"]: item["outcome"] for item in report["attempts"]} == {
        "list A's /proc/PID/fd": "allowed", "read A's ring link": "allowed", "open A's ring via /proc": "EACCES"}
    assert {item["outcome"] for item in report["reads"]} == {"EACCES"}, report  # the journal is the daemon's

    code, out, err = layout.finish(attacker)
    assert code == 0, err
    report = json.loads(out)
    expected = {
        "list A's /proc/PID/fd": "EACCES",
        "read A's ring link": "EACCES",
        "open A's ring read-write via /proc": "EACCES",
        "open A's ring read-only via /proc": "EACCES",
        "list A's /proc/PID/map_files": "EACCES",
        "open A's /proc/PID/mem": "EACCES",
        "list the daemon's /proc/PID/fd": "EACCES",
        "shm_open arena": "PermissionsError",
        "join A's group": "NotAllowed",
        "ftruncate own ring smaller": "EPERM",
        "ftruncate own ring larger": "EPERM",
        "seal own ring against writes": "EPERM",
        "ftruncate the status page": "EINVAL",
        "map the status page writable": "EACCES",
        "re-open the status page read-write via /proc/self/fd": "EACCES",
    }
    for segment in ("arena", "clients", "lock", "secret"):
        expected.update({f"open {segment} read-only": "EACCES", f"open {segment} read-write": "EACCES",
                         f"truncate {segment}": "EACCES"})
    expected["open lock read-only"] = "allowed"  # 0644: anyone may try the lock and see who holds it
    assert {item["what"]: item["outcome"] for item in report["attempts"]} == expected
    assert report["shm_names"] == sorted(f"wheeld-{name}-{s}" for s in ("arena", "clients", "lock", "secret")), \
        "a ring or page has a name in /dev/shm"
    assert report["ring_size"][0] == report["ring_size"][1]
    assert report["socket_path"] == layout.socket_path
    got_all(report["own_timers"], 50)  # the second worker's own timers work
    one_line_error(report["stats"], 3, "may not read the wheeld arena")  # not in the monitoring group

    # B is gone: the daemon forgets its client slot in its periodic collection of departed
    # clients (code that runs only then, as the daemon's user: waited for, so that every
    # run covers it, however fast the machine gets through the rest)
    wait_until(lambda: re.search(rf"client slot \d+ \(pid {attacker.pid}\) released", layout.log()), 30,
               "the daemon to release worker B's client slot", interval=0.05, detail=layout.log)

    # the operator: wheelctl's readers with a monitoring group, exit 3 and one line without
    code, out, err = layout.finish(operator)
    assert code == 0, err
    runs = json.loads(out)["runs"]
    if monitors:
        for run, word in zip(runs, ("pending", "group ids in use", "ok:")):
            assert (run["code"], run["err"]) == (0, ""), run
            assert word in run["out"], run
    else:
        for run in runs:
            one_line_error(run, 3, "may not read the wheeld arena")

    # the outsider: the socket refuses it; then, the socket widened, the daemon does
    first = json.loads(outsider.stdout.readline())
    assert first["connect"]["error"] == "NotAllowed" and "Permission denied" in first["connect"]["message"], first
    one_line_error(first["add"], 3, "permission denied")
    one_line_error(first["stats"], 3, "may not read the wheeld arena")
    assert {item["outcome"] for item in first["reads"]} == {"EACCES"}, first
    mode = stat.S_IMODE(os.stat(layout.socket_path).st_mode)
    os.chmod(layout.socket_path, 0o666)
    try:
        outsider.stdin.write("widened\n")
        outsider.stdin.flush()
        second = json.loads(layout.finish(outsider)[1])
    finally:
        os.chmod(layout.socket_path, mode)
    assert second["connect"]["error"] == "NotAllowed", second
    assert "is not allowed to use this wheeld" in second["connect"]["message"], second
    one_line_error(second["add"], 3, "is not allowed to use this wheeld")

    # A got every expiration of its own, once, never early, while all of that went on
    holder.stdin.write("stop\n")
    holder.stdin.flush()
    code, out, err = layout.finish(holder)
    assert code == 0, err
    report = json.loads(out)
    assert report["added"] > 0
    got_all(report, report["added"])

    # the journal: directory 0750, files 0640, the daemon's
    owner = (0, 0) if layout.as_root else (ids["daemon"].uid, ids["daemon"].gid)
    st = os.stat(journal)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (*owner, 0o750)
    files = os.listdir(journal)
    assert files
    for entry in files:
        st = os.stat(os.path.join(journal, entry))
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (*owner, 0o640), entry


def check_daemon_process(layout: Layout) -> None:
    """The daemon runs with exactly the identity, umask and /proc the unit gives it."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{layout.daemon.pid}/status").read_text().splitlines())
    identity = layout.daemon_as
    assert [int(v) for v in status["Uid"].split()] == [identity["uid"]] * 4
    assert [int(v) for v in status["Gid"].split()] == [identity["gid"]] * 4
    assert sorted(int(v) for v in status["Groups"].split()) == identity["groups"]
    assert int(status["Umask"], 8) == identity["umask"]
    proc_mounts = [line.split() for line in Path(f"/proc/{layout.daemon.pid}/mountinfo").read_text().splitlines()
                   if line.split()[4] == "/proc"]
    assert proc_mounts, "the daemon sees no /proc"
    options = set(proc_mounts[-1][-1].split(","))  # the topmost mount: per-superblock options come last
    assert set(identity["proc"].split(",")) <= options, proc_mounts[-1]


def stop_daemon(layout: Layout) -> None:
    layout.daemon.send_signal(signal.SIGTERM)
    assert layout.daemon.wait(20) == 0, layout.log()
    assert "Traceback" not in layout.log(), layout.log()
    assert "imported after the identity change" not in layout.log(), layout.log()


def test_unit_identities(layout_factory, people):
    """The daemon as the unit runs it (user wheeld, supplementary wheeld-monitor, its umask, its
    /proc, socket activation): workers, the operator and an outsider each get what the model says."""
    layout = layout_factory(daemon_as_root=False)
    layout.start_daemon()
    daemon, monitor = layout.ids["daemon"], people["monitor_gid"]
    assert shm_mode(layout.name, "arena") == (daemon.uid, monitor, 0o640)
    assert shm_mode(layout.name, "clients") == (daemon.uid, monitor, 0o640)
    assert shm_mode(layout.name, "lock") == (daemon.uid, daemon.gid, 0o644)
    assert shm_mode(layout.name, "secret") == (daemon.uid, daemon.gid, 0o600)
    assert people["clients_gid"] not in layout.daemon_as["groups"]  # the daemon needs no clients group
    assert monitor in layout.daemon_as["groups"]
    check_daemon_process(layout)
    check_isolation(layout, monitors=True)
    stop_daemon(layout)


def test_root_daemon(layout_factory):
    """The same isolation with the daemon running as root and no monitoring group (arena 0600)."""
    layout = layout_factory(daemon_as_root=True)
    layout.start_daemon()
    for segment in ("arena", "clients", "secret"):
        assert shm_mode(layout.name, segment) == (0, 0, 0o600)
    assert shm_mode(layout.name, "lock") == (0, 0, 0o644)
    check_daemon_process(layout)
    check_isolation(layout, monitors=False)
    stop_daemon(layout)
