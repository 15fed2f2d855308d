"""Run wheeld, wheelctl or a client role as another user, the way tests/test_installed_layout.py needs.

Usage (as root)::

    python tests/layout_roles.py IDENTITY_JSON ROLE [ARG...]

``IDENTITY_JSON`` says who to become and in what surroundings::

    {"uid": 998, "gid": 998, "groups": [997], "umask": 63,
     "listen_fd": 5,                      # optional: hand this fd to wheeld as socket activation does
     "proc": "hidepid=invisible,subset=pid",  # optional: a private /proc mounted so (ProtectProc=, ProcSubset=)
     "system_socket_dir": "/tmp/x/run/wheeld",  # optional: stands in for /run/wheeld in the default lookup
     "env": {"WHEELD_NAME": "..."}}

Why not ``subprocess.Popen(user=...)``: the interpreter running the tests may live
where the throwaway users cannot read it (a pyenv under /root), and so may the
checkout and its venv (a clone under /root). So this script imports everything it
will need while it is still root, then drops to the identity *in the same process*
(``setgroups``, ``setgid``, ``setuid``) and runs the role. That includes what
libraries import on first use (numpy loads ``numpy.ma`` inside ``np.unique``,
which the daemon's collection of departed clients calls): :data:`LAZY_MODULES`.
After the identity change no module may be imported at all (:class:`NoImports`
refuses it, naming it), wherever the tree lives: an import that works only because
the tree happens to be readable would make the tests pass or fail by the clone's
location and by timing. A process that changed uid is made non-dumpable by the kernel, which
would hide its /proc/PID/fd even from its own uid; ``PR_SET_DUMPABLE`` puts back
what an ``exec`` would have given, so the /proc checks test the uid rule.

For ``wheeld`` with ``listen_fd`` the descriptor is moved to fd 3 and
``LISTEN_FDS=1``, ``LISTEN_PID`` (this process, which becomes the daemon),
``LISTEN_FDNAMES=wheeld`` are set, as systemd does for ``wheeld.socket``.

Roles other than ``wheeld`` print JSON documents on stdout; ``wheelctl`` commands
run in-process (:func:`run_wheelctl`), one process per identity, to keep the tests fast.
"""

from __future__ import annotations

import _imp
import contextlib
import ctypes
import errno
import fcntl
import io
import json
import mmap
import os
import pkgutil
import select
import sys
import time
import traceback

import click  # noqa: F401
import msgspec  # noqa: F401
import numpy  # noqa: F401
import posix_ipc
import uvloop  # noqa: F401

import wheeld
import wheeld.daemon
import wheeld.protocol
import wheeld.shm
from wheeld.protocol import naming

for _package in (wheeld, wheeld.daemon, wheeld.shm, wheeld.protocol):  # wheeld: the client's modules
    for _module in pkgutil.iter_modules(_package.__path__, _package.__name__ + "."):
        __import__(_module.name)

# what the libraries import on first use rather than at their own import: numpy's
# submodules behind numpy.__getattr__ (np.unique imports numpy.ma, for one) and the
# codecs a stream's encoding is looked up in (click asks for "ascii")
LAZY_MODULES = ("numpy.ma", "numpy.linalg", "numpy.fft", "numpy.random", "numpy.polynomial", "numpy.dtypes",
                "numpy.exceptions", "numpy.rec", "numpy.char", "numpy.ctypeslib", "encodings.ascii",
                "encodings.latin_1", "encodings.idna")
for _module in LAZY_MODULES:
    __import__(_module)
import grp  # noqa: E402,F401
import linecache  # noqa: E402,F401
import pwd  # noqa: E402,F401
import tokenize  # noqa: E402,F401

from wheeld import ctl  # noqa: E402
from wheeld.daemon import cli  # noqa: E402
from wheeld.shm.status import StatusPage  # noqa: E402

_libc = ctypes.CDLL(None, use_errno=True)
_PR_SET_DUMPABLE = 4
_CLONE_NEWNS = 0x00020000
_MS_REC, _MS_PRIVATE = 0x4000, 1 << 18


def _check(result: int, what: str) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")


def _private_proc(options: str) -> None:
    """What ProtectProc=/ProcSubset= do: this process gets its own /proc, mounted with ``options``."""
    _check(_libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _check(_libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None), "mount --make-rprivate /")
    _check(_libc.mount(b"proc", b"/proc", b"proc", 0, options.encode()), f"mount proc -o {options}")


class NoImports:
    """A ``sys.meta_path`` finder, first in line after the identity change: every module
    not imported by then is refused with an ImportError naming it (builtin and frozen
    modules, which need no file, excepted)."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name in sys.builtin_module_names or _imp.is_frozen(name):
            return None
        message = (f"layout_roles: {name} imported after the identity change (the tree may not be readable "
                   "by this user): import it beforehand (LAZY_MODULES)")
        print(message, file=sys.stderr, flush=True)
        raise ImportError(message, name=name)


def become(identity: dict) -> None:
    if identity.get("proc"):
        _private_proc(identity["proc"])
    listen_fd = identity.get("listen_fd")
    if listen_fd is not None:
        if listen_fd != 3:
            os.dup2(listen_fd, 3)
            os.close(listen_fd)
        os.set_inheritable(3, True)
        os.environ.update(LISTEN_FDS="1", LISTEN_PID=str(os.getpid()), LISTEN_FDNAMES="wheeld")
    if identity.get("system_socket_dir"):
        naming.SYSTEM_SOCKET_DIR = identity["system_socket_dir"]
    os.environ.update(identity.get("env", {}))
    os.setgroups(identity["groups"])
    os.setgid(identity["gid"])
    os.setuid(identity["uid"])
    _check(_libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")
    os.umask(identity.get("umask", 0o022))
    sys.meta_path.insert(0, NoImports)


# --------------------------------------------------------------------- roles
def _attempt(results: list, what: str, action) -> None:
    """Run ``action``; record 'allowed' or the errno name / exception type it failed with."""
    try:
        action()
        outcome = "allowed"
    except OSError as exc:
        outcome = errno.errorcode.get(exc.errno, str(exc.errno)) if exc.errno else type(exc).__name__
    except Exception as exc:  # noqa: BLE001 - recorded for the test to judge
        outcome = type(exc).__name__
    results.append({"what": what, "outcome": outcome})


def _receive_all(client, keys: set, timeout_s: float = 10.0) -> dict:
    """Poll until every key in ``keys`` came back once; counts of what arrived."""
    seen: dict = {}
    early = 0
    end = time.monotonic() + timeout_s
    while len(set(seen) & keys) < len(keys) and time.monotonic() < end:
        for expired in client.poll(timeout_s=0.2):
            seen[expired.key] = seen.get(expired.key, 0) + 1
            early += expired.fired_ms < expired.deadline_ms
    return {"expected": len(keys), "received": len(set(seen) & keys),
            "duplicates": sum(n - 1 for n in seen.values()), "foreign": len(set(seen) - keys), "early": early}


def run_wheelctl(args: list[str]) -> dict:
    """``wheelctl ARGS`` as its console script runs it (``ctl.main()``), here in-process:
    exit code, stdout, stderr; an exception click does not handle is printed as the
    interpreter would (a traceback), which is what the tests look for."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            ctl.main(args, prog_name="wheelctl")
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
            code = 1
    return {"args": args, "code": code, "out": out.getvalue(), "err": err.getvalue()}


def role_ctl(*commands: str) -> dict:
    """Each argument is one wheelctl command line (JSON list)."""
    return {"runs": [run_wheelctl(json.loads(command)) for command in commands]}


def role_holder(group: str) -> dict:
    """Worker A: connects by the default lookup, says where its ring is, then keeps adding,
    flushing and receiving until stdin says stop."""
    client = wheeld.connect(group=group, connect_timeout_s=5.0, reconnect_timeout_s=5.0)
    print(json.dumps({"pid": os.getpid(), "ring_fd": client._segment.fd, "socket_path": client.socket_path}),
          flush=True)
    keys: set = set()
    seen: dict = {}
    early = 0
    batch = 0
    stop = False
    while not stop:
        stop = bool(select.select([sys.stdin], [], [], 0)[0])
        if not stop:
            for i in range(25):
                key = f"a-{batch}-{i}"
                keys.add(key)
                client.add(key, 1 + i)
            client.flush()
            batch += 1
        for expired in client.poll(timeout_s=0.02):
            seen[expired.key] = seen.get(expired.key, 0) + 1
            early += expired.fired_ms < expired.deadline_ms
    rest = _receive_all(client, keys - set(seen))
    client.close()
    return {"added": len(keys), "received": len(set(seen) & keys) + rest["received"],
            "duplicates": sum(n - 1 for n in seen.values()) + rest["duplicates"],
            "early": early + rest["early"], "foreign": len(set(seen) - keys) + rest["foreign"]}


def role_probe(pid: str, fd: str, *paths: str) -> dict:
    """The same uid as worker A: its /proc/PID/fd is open to us (the control for role_attacker:
    there the uid rule refuses it). Opening the ring through it fails even here: the memfd's
    mode is 0600 and it belongs to the daemon. Then: may we read ``paths``?"""
    results: list = []
    _attempt(results, "list A's /proc/PID/fd", lambda: os.listdir(f"/proc/{pid}/fd"))
    _attempt(results, "read A's ring link", lambda: os.readlink(f"/proc/{pid}/fd/{fd}"))
    _attempt(results, "open A's ring via /proc", lambda: os.close(os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY)))
    return {"attempts": results, "reads": _reads(paths)}


def _reads(paths) -> list:
    results: list = []
    for path in paths:
        if os.path.isdir(path):
            _attempt(results, f"list {path}", lambda path=path: os.listdir(path))
        else:
            _attempt(results, f"read {path}", lambda path=path: open(path, "rb").close())
    return results


def role_attacker(name: str, a_pid: str, a_ring_fd: str, daemon_pid: str, a_group: str) -> dict:
    """Worker B: everything it might try against worker A, the daemon's segments and its own;
    and its own timers, which must still work."""
    results: list = []
    a_fd_path = f"/proc/{a_pid}/fd/{a_ring_fd}"
    _attempt(results, "list A's /proc/PID/fd", lambda: os.listdir(f"/proc/{a_pid}/fd"))
    _attempt(results, "read A's ring link", lambda: os.readlink(a_fd_path))
    _attempt(results, "open A's ring read-write via /proc", lambda: os.close(os.open(a_fd_path, os.O_RDWR)))
    _attempt(results, "open A's ring read-only via /proc", lambda: os.close(os.open(a_fd_path, os.O_RDONLY)))
    _attempt(results, "list A's /proc/PID/map_files", lambda: os.listdir(f"/proc/{a_pid}/map_files"))
    _attempt(results, "open A's /proc/PID/mem", lambda: os.close(os.open(f"/proc/{a_pid}/mem", os.O_RDONLY)))
    _attempt(results, "list the daemon's /proc/PID/fd", lambda: os.listdir(f"/proc/{daemon_pid}/fd"))
    for segment in ("arena", "clients", "lock", "secret"):
        path = f"/dev/shm/wheeld-{name}-{segment}"
        _attempt(results, f"open {segment} read-only", lambda path=path: os.close(os.open(path, os.O_RDONLY)))
        _attempt(results, f"open {segment} read-write", lambda path=path: os.close(os.open(path, os.O_RDWR)))
        _attempt(results, f"truncate {segment}", lambda path=path: os.truncate(path, 0))
    _attempt(results, "shm_open arena",
             lambda: posix_ipc.SharedMemory(f"/wheeld-{name}-arena", read_only=True).close_fd())
    shm_names = sorted(entry for entry in os.listdir("/dev/shm") if entry.startswith(f"wheeld-{name}-"))

    _attempt(results, "join A's group", lambda: wheeld.connect(group=a_group, connect_timeout_s=5.0).close())

    # B's own session: the descriptors the daemon gave B, and what B cannot do with them
    status_fds: list[int] = []
    original_attach = StatusPage.attach.__func__

    def keep_a_copy(cls, fd):
        status_fds.append(os.dup(fd))
        return original_attach(cls, fd)

    StatusPage.attach = classmethod(keep_a_copy)
    with wheeld.connect(group=f"{a_group}-b", connect_timeout_s=5.0) as client:
        ring = client._segment.fd
        size = os.fstat(ring).st_size
        _attempt(results, "ftruncate own ring smaller", lambda: os.ftruncate(ring, 0))
        _attempt(results, "ftruncate own ring larger", lambda: os.ftruncate(ring, size * 2))
        _attempt(results, "seal own ring against writes",
                 lambda: fcntl.fcntl(ring, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE))
        status = status_fds[0]
        _attempt(results, "ftruncate the status page", lambda: os.ftruncate(status, 0))
        _attempt(results, "map the status page writable", lambda: mmap.mmap(status, mmap.PAGESIZE).close())
        _attempt(results, "re-open the status page read-write via /proc/self/fd",
                 lambda: os.close(os.open(f"/proc/self/fd/{status}", os.O_RDWR)))
        keys = {f"b-{i}" for i in range(50)}
        for i, key in enumerate(sorted(keys)):
            client.add(key, 1 + i % 20)
        client.flush()
        own = _receive_all(client, keys)
        ring_size_after = os.fstat(ring).st_size
        socket_path = client.socket_path
    os.close(status)
    return {"attempts": results, "shm_names": shm_names, "own_timers": own, "ring_size": [size, ring_size_after],
            "socket_path": socket_path, "stats": run_wheelctl(["stats", "--interval", "0"])}


def _refused(group: str) -> dict:
    try:
        wheeld.connect(group=group, connect_timeout_s=5.0).close()
    except wheeld.WheeldError as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"error": None, "message": ""}


def role_outsider(group: str, *paths: str) -> dict:
    """Neither client nor monitor: connect, wheelctl, read ``paths``; print that; then, once
    stdin says the socket was widened, connect and wheelctl again."""
    print(json.dumps({"connect": _refused(group), "reads": _reads(paths),
                      "add": run_wheelctl(["add", "k", "1000", "--group", group]),
                      "stats": run_wheelctl(["stats", "--interval", "0"])}), flush=True)
    sys.stdin.readline()
    return {"connect": _refused(group), "add": run_wheelctl(["add", "k", "1000", "--group", group])}


ROLES = {"ctl": role_ctl, "holder": role_holder, "probe": role_probe, "attacker": role_attacker,
         "outsider": role_outsider}


def main() -> None:
    identity = json.loads(sys.argv[1])
    role, args = sys.argv[2], sys.argv[3:]
    become(identity)
    if role == "wheeld":
        cli.main(args, prog_name="wheeld")
    else:
        print(json.dumps(ROLES[role](*args)), flush=True)


if __name__ == "__main__":
    main()
