"""The systemd units: verified, scored, and their sandbox checked against what wheeld needs.

``systemd-analyze verify`` exits 0 on unknown keys and bad values (it logs and
ignores them), so a unit is clean only when verify writes *nothing* to stderr;
a test proves this check catches a typo. Verify wants the ``ExecStart=``
binary to exist, so the units are verified from a temporary copy whose
``/usr/local/bin/wheeld`` is replaced by this Python interpreter; nothing else
is changed. ``User=wheeld`` stays: systemd 252's verify does not resolve users
(it never starts anything), so the unit verifies on a machine where
systemd/sysusers.conf was never applied, and substituting ``User=root`` would
only verify a unit nobody ships. The sysusers and tmpfiles files are checked by
applying them to a temporary root (``--root``), never to this machine.

``systemd-analyze security --offline=yes`` gives the service an overall
exposure score (0 = locked down, 10 = exposed); docs/operating.md records it
and the test keeps the unit from drifting above it (margin 0.2).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SYSTEMD_DIR = REPO / "systemd"
OPERATING_DOC = REPO / "docs" / "operating.md"
INSTALLED_BINARY = "/usr/local/bin/wheeld"

# Measured with systemd 252 on the shipped unit; docs/operating.md says the same.
RECORDED_EXPOSURE = 1.3
EXPOSURE_MARGIN = 0.2

systemd_analyze = shutil.which("systemd-analyze")
needs_systemd_analyze = pytest.mark.skipif(systemd_analyze is None, reason="systemd-analyze is not installed")


def unit_lines(path: Path) -> list[tuple[str, str, str]]:
    """(section, key, value) for every assignment, in order; keys may repeat."""
    section = ""
    assignments = []
    for raw_line in path.read_text().splitlines():
        line = raw_line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, _, value = line.partition("=")
        assignments.append((section, key.strip(), value.strip()))
    return assignments


def values(path: Path, section: str, key: str) -> list[str]:
    return [value for (s, k, value) in unit_lines(path) if (s, k) == (section, key)]


def copy_units(destination: Path) -> Path:
    """Both units in ``destination`` (the socket needs its service beside it), ExecStart made runnable."""
    for name in ("wheeld.service", "wheeld.socket"):
        text = (SYSTEMD_DIR / name).read_text()
        if name == "wheeld.service":
            assert f"ExecStart={INSTALLED_BINARY} " in text
            text = text.replace(f"ExecStart={INSTALLED_BINARY} ", f"ExecStart={os.path.realpath(sys.executable)} ")
        (destination / name).write_text(text)
    return destination


def verify(*unit_paths: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [systemd_analyze, "verify", "--man=no", *map(str, unit_paths)],
        capture_output=True, text=True, timeout=60, env={**os.environ, "SYSTEMD_LOG_COLOR": "0"},
    )


def verify_problems(*unit_paths: Path) -> str:
    """Everything verify complained about: its stderr, plus the exit status if non-zero."""
    result = verify(*unit_paths)
    problems = result.stderr.strip()
    if result.returncode != 0:
        problems += f"\n(exit status {result.returncode})"
    return problems.strip()


@needs_systemd_analyze
def test_both_units_verify_without_a_single_complaint(tmp_path):
    units = copy_units(tmp_path)
    assert verify_problems(units / "wheeld.service", units / "wheeld.socket") == ""


@needs_systemd_analyze
@pytest.mark.parametrize(
    ("unit", "original", "broken"),
    [
        ("wheeld.service", "WatchdogSec=10s", "WatchdogSecs=10s"),  # unknown key
        ("wheeld.service", "Restart=on-failure", "Restart=on-failures"),  # bad value
        ("wheeld.service", "RemoveIPC=no", "RemoveIPC=nope"),  # bad boolean
        ("wheeld.socket", "SocketMode=0660", "SocketMode=0966"),  # not an octal mode
        ("wheeld.socket", "ListenStream=/run/wheeld/default.sock", "ListenStreem=/run/wheeld/default.sock"),
    ],
)
def test_the_check_catches_a_broken_unit(tmp_path, unit, original, broken):
    units = copy_units(tmp_path)
    text = (units / unit).read_text()
    assert original in text
    (units / unit).write_text(text.replace(original, broken))
    result = verify(units / "wheeld.service", units / "wheeld.socket")
    assert verify_problems(units / "wheeld.service", units / "wheeld.socket") != ""
    # The pitfall this guards against: only stderr tells (verify may still exit 0).
    assert result.stderr.strip() != ""


def overall_exposure(service: Path) -> float:
    result = subprocess.run(
        [systemd_analyze, "security", "--offline=yes", "--no-pager", str(service)],
        capture_output=True, text=True, timeout=60, env={**os.environ, "SYSTEMD_LOG_COLOR": "0"},
    )
    match = re.search(r"Overall exposure level for wheeld\.service: (\d+(?:\.\d+)?)", result.stdout)
    assert match, f"no overall exposure in output:\n{result.stdout}\n{result.stderr}"
    return float(match.group(1))


@needs_systemd_analyze
def test_security_exposure_stays_at_the_recorded_level(tmp_path):
    exposure = overall_exposure(copy_units(tmp_path) / "wheeld.service")
    assert exposure <= RECORDED_EXPOSURE + EXPOSURE_MARGIN, (
        f"exposure {exposure} is above the recorded {RECORDED_EXPOSURE}: a hardening line was lost"
    )


def test_operating_guide_records_the_exposure_score():
    assert f"Overall exposure level for wheeld.service: {RECORDED_EXPOSURE}" in OPERATING_DOC.read_text()


@needs_systemd_analyze
def test_exposure_parser_sees_a_weaker_unit(tmp_path):
    """The score is read from the output, not assumed: strip the sandbox and it rises."""
    units = copy_units(tmp_path)
    service = units / "wheeld.service"
    kept = [line for line in service.read_text().splitlines()
            if not line.startswith(("Protect", "Private", "SystemCall", "Restrict"))]
    service.write_text("\n".join(kept) + "\n")
    assert overall_exposure(service) > RECORDED_EXPOSURE + EXPOSURE_MARGIN


# --- what wheeld needs from the unit, which verify cannot know -----------

SERVICE = SYSTEMD_DIR / "wheeld.service"
SOCKET = SYSTEMD_DIR / "wheeld.socket"


def test_service_is_a_watched_notify_service():
    assert values(SERVICE, "Service", "Type") == ["notify"]
    assert values(SERVICE, "Service", "NotifyAccess") == ["main"]
    assert values(SERVICE, "Service", "WatchdogSec") == ["10s"]
    assert values(SERVICE, "Service", "Restart") == ["on-failure"]


def test_sandbox_keeps_shared_memory_shared_with_clients():
    # DynamicUser= implies RemoveIPC=yes; RemoveIPC=yes deletes the segments on stop.
    assert values(SERVICE, "Service", "DynamicUser") == []
    assert values(SERVICE, "Service", "RemoveIPC") == ["no"]
    # A user namespace would turn clients' uids into nobody (allow lists, group owners).
    assert values(SERVICE, "Service", "PrivateIPC") == []
    assert values(SERVICE, "Service", "PrivateUsers") == []
    # No path the clients use may be hidden by the sandbox.
    hiding = values(SERVICE, "Service", "InaccessiblePaths") + values(SERVICE, "Service", "TemporaryFileSystem")
    assert not any(path.startswith(("/dev", "/run")) for path in hiding)
    assert "/tmp" not in values(SOCKET, "Socket", "ListenStream")[0]


def test_the_socket_the_service_is_told_about_is_the_one_systemd_creates():
    exec_start = values(SERVICE, "Service", "ExecStart")[0].split()
    assert exec_start[0] == INSTALLED_BINARY
    socket_path = exec_start[exec_start.index("--socket") + 1]
    assert values(SOCKET, "Socket", "ListenStream") == [socket_path]
    runtime_directory = values(SERVICE, "Service", "RuntimeDirectory")[0]
    assert Path(socket_path).parent == Path("/run") / runtime_directory
    assert values(SOCKET, "Socket", "SocketMode") == ["0660"]
    assert values(SOCKET, "Socket", "SocketGroup") == ["wheeld-clients"]


def test_the_socket_is_where_clients_look_by_default():
    """Workers and wheelctl find /run/wheeld/NAME.sock by themselves for instance 'default'."""
    from wheeld.protocol import naming

    expected = os.path.join(naming.SYSTEM_SOCKET_DIR, f"{naming.DEFAULT_NAME}.sock")
    assert values(SOCKET, "Socket", "ListenStream") == [expected]
    exec_start = values(SERVICE, "Service", "ExecStart")[0].split()
    assert "--name" not in exec_start  # the instance is 'default'


def option(name: str) -> str:
    exec_start = values(SERVICE, "Service", "ExecStart")[0].split()
    assert exec_start.count(name) == 1, f"ExecStart= should have {name} once"
    return exec_start[exec_start.index(name) + 1]


def test_the_daemon_refuses_non_clients_and_hands_its_arena_to_the_monitors():
    assert option("--allow-group") == values(SOCKET, "Socket", "SocketGroup")[0]
    assert option("--monitor-group") == "wheeld-monitor"
    # the daemon must belong to the monitoring group to chown to it, and needs no other group
    assert values(SERVICE, "Service", "SupplementaryGroups") == ["wheeld-monitor"]
    assert values(SERVICE, "Service", "UMask") == ["0077"]
    state_directory = values(SERVICE, "Service", "StateDirectory")[0]
    assert option("--journal").startswith(f"/var/lib/{state_directory}/")


def sysusers_entries() -> list[list[str]]:
    entries = []
    for line in (SYSTEMD_DIR / "sysusers.conf").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            entries.append(line.split())
    return entries


def test_units_sysusers_and_tmpfiles_name_the_same_user_and_groups():
    created = {(entry[0], entry[1]) for entry in sysusers_entries()}
    user = values(SERVICE, "Service", "User")[0]
    assert ("u", user) in created
    assert values(SERVICE, "Service", "Group") == [user]  # 'u' creates the same-named group
    client_group = values(SOCKET, "Socket", "SocketGroup")[0]
    assert ("g", client_group) in created
    monitor_group = option("--monitor-group")
    assert ("g", monitor_group) in created
    assert values(SERVICE, "Service", "SupplementaryGroups") == [monitor_group]
    memberships = [entry[1:3] for entry in sysusers_entries() if entry[0] == "m"]
    assert memberships == [[user, monitor_group]]  # and not the clients group
    tmpfiles_entry = [line.split() for line in (SYSTEMD_DIR / "wheeld.tmpfiles").read_text().splitlines()
                      if line.startswith("d ")]
    runtime_directory = "/run/" + values(SERVICE, "Service", "RuntimeDirectory")[0]
    assert tmpfiles_entry == [["d", runtime_directory, values(SERVICE, "Service", "RuntimeDirectoryMode")[0],
                               user, user, "-"]]


@pytest.mark.skipif(os.geteuid() != 0, reason="tmpfiles must chown to the new user")
@pytest.mark.skipif(not (shutil.which("systemd-sysusers") and shutil.which("systemd-tmpfiles")),
                    reason="no systemd-sysusers/tmpfiles")
def test_sysusers_and_tmpfiles_apply_to_a_fresh_root(tmp_path):
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    sysusers = subprocess.run(
        ["systemd-sysusers", f"--root={root}", str(SYSTEMD_DIR / "sysusers.conf")],
        capture_output=True, text=True, timeout=60,
    )
    assert sysusers.returncode == 0, sysusers.stderr
    passwd = {line.split(":")[0]: line.split(":") for line in (root / "etc/passwd").read_text().splitlines()}
    groups = {line.split(":")[0]: line.split(":") for line in (root / "etc/group").read_text().splitlines()}
    assert "wheeld" in passwd and int(passwd["wheeld"][2]) < 1000  # a system user
    assert passwd["wheeld"][6] in ("/usr/sbin/nologin", "/sbin/nologin", "/bin/false")
    assert groups["wheeld-monitor"][3].split(",") == ["wheeld"]
    assert groups["wheeld-clients"][3] == ""

    tmpfiles = subprocess.run(
        ["systemd-tmpfiles", "--create", f"--root={root}", str(SYSTEMD_DIR / "wheeld.tmpfiles")],
        capture_output=True, text=True, timeout=60,
    )
    assert (tmpfiles.returncode, tmpfiles.stderr) == (0, "")
    runtime_directory = (root / "run/wheeld").stat()
    assert runtime_directory.st_uid == int(passwd["wheeld"][2])
    assert runtime_directory.st_gid == int(passwd["wheeld"][3])
    assert runtime_directory.st_mode & 0o7777 == 0o755


# MemoryDenyWriteExecute=yes: systemd enforces it with seccomp; Linux >= 6.3
# has the same rule as prctl(PR_SET_MDWE). Run what the daemon is built from
# under it: if any of it needed writable+executable memory, the unit would
# kill the daemon at start.
MDWE_PROGRAM = textwrap.dedent(
    """
    import ctypes, mmap, sys
    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN = 65, 1
    if libc.prctl(PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN, 0, 0, 0) != 0:
        sys.exit(77)  # kernel without PR_SET_MDWE
    try:
        mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
        sys.exit("W+X mapping was allowed: MDWE is not in force")
    except PermissionError:
        pass

    import asyncio, os, socket, tempfile
    import click, msgspec, numpy, posix_ipc, uvloop
    import wheeld.daemon.activation, wheeld.daemon.sdnotify

    name = sys.argv[1]
    segment = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=1 << 16)
    try:
        arena = mmap.mmap(segment.fd, segment.size)
        arena[:8] = (42).to_bytes(8, "little")
        assert numpy.frombuffer(arena, dtype=numpy.int64, count=1)[0] == 42
        del arena
    finally:
        segment.close_fd()
        posix_ipc.unlink_shared_memory(name)

    class Ping(msgspec.Struct, array_like=True, tag=True):
        seq: int

    async def round_trip(path):
        async def echo(reader, writer):
            writer.write(await reader.read())
            await writer.drain()
            writer.close()
        server = await asyncio.start_unix_server(echo, path)
        reader, writer = await asyncio.open_unix_connection(path)
        writer.write(msgspec.msgpack.encode(Ping(7)))
        writer.write_eof()
        data = await reader.read()
        writer.close()
        server.close()
        return data

    with tempfile.TemporaryDirectory() as directory:
        data = uvloop.run(round_trip(os.path.join(directory, "s")))
    assert msgspec.msgpack.decode(data, type=Ping) == Ping(7)
    print("ok")
    """
)


def test_daemon_runtime_works_without_writable_executable_memory():
    segment_name = f"/wheeld-test-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    try:
        result = subprocess.run(
            [sys.executable, "-c", MDWE_PROGRAM, segment_name], capture_output=True, text=True, timeout=60
        )
    finally:
        try:
            import posix_ipc

            posix_ipc.unlink_shared_memory(segment_name)
        except posix_ipc.ExistentialError:
            pass  # the child unlinked it, as it should
    if result.returncode == 77:
        pytest.skip("kernel has no PR_SET_MDWE (Linux < 6.3)")
    assert (result.returncode, result.stdout.strip()) == (0, "ok"), result.stderr


def test_the_guides_virtual_environment_is_made_by_an_interpreter_the_service_can_see(tmp_path):
    """A virtual environment links to the interpreter that made it: the guide must name one
    outside the directories ProtectHome= hides (an interpreter of pyenv under /root would
    leave /opt/wheeld/bin/python pointing into the dark), and the environment it makes must
    say so in pyvenv.cfg."""
    service = (REPO / "systemd" / "wheeld.service").read_text()
    assert "ProtectHome=yes" in service
    hidden = ("/home", "/root", "/run/user")  # what ProtectHome=yes makes inaccessible (systemd.exec(5))
    guide = (REPO / "docs" / "operating.md").read_text()
    install = guide.split("\n## Install\n", 1)[1].split("\n## ", 1)[0]
    lines = [line.split() for block in re.findall(r"```sh\n(.*?)```", install, re.S) for line in block.splitlines()]
    venv = [argv for argv in lines if argv[1:3] == ["-m", "venv"]]
    assert len(venv) == 1, venv
    interpreter, target = venv[0][0], venv[0][3]
    assert os.path.isabs(interpreter), (f"the guide makes the environment with {interpreter!r}: "
                                        "a PATH lookup may find pyenv's")
    assert not interpreter.startswith(hidden) and not target.startswith(hidden)
    if not os.access(interpreter, os.X_OK):
        pytest.skip(f"{interpreter} is not installed here")
    made = tmp_path / "venv"
    subprocess.run([interpreter, "-m", "venv", "--without-pip", str(made)], check=True, capture_output=True,
                   timeout=120)
    home = dict(line.split(" = ", 1) for line in (made / "pyvenv.cfg").read_text().splitlines()
                if " = " in line)["home"]
    assert not os.path.realpath(home).startswith(hidden), home
    assert "pyvenv.cfg" in install and all(h in install for h in hidden)  # the guide says where to look


@needs_systemd_analyze
def test_the_fleet_drop_in_verifies_and_keeps_the_service_options(tmp_path):
    units = copy_units(tmp_path)
    drop_in = (SYSTEMD_DIR / "wheeld-fleet.conf").read_text()
    assert f"ExecStart={INSTALLED_BINARY} " in drop_in
    (units / "wheeld.service.d").mkdir()
    (units / "wheeld.service.d" / "fleet.conf").write_text(
        drop_in.replace(f"ExecStart={INSTALLED_BINARY} ", f"ExecStart={os.path.realpath(sys.executable)} "))
    assert verify_problems(units / "wheeld.service", units / "wheeld.socket") == ""
    # the drop-in's ExecStart is the service's, plus the replication
    base = values(SYSTEMD_DIR / "wheeld.service", "Service", "ExecStart")[0]
    fleet = [v for v in values(SYSTEMD_DIR / "wheeld-fleet.conf", "Service", "ExecStart") if v]
    assert fleet == [base + " --replicate ${WHEELD_NATS_URLS} $WHEELD_FLEET_ARGS"]
    # a host that stood down (fenced) is not restarted
    assert "69" in values(SYSTEMD_DIR / "wheeld.service", "Service", "RestartPreventExitStatus")[0].split()
