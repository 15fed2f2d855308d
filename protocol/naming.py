"""Where a wheeld instance lives: its socket path and its shared-memory names.

Shared by the daemon, which creates them, and by the client library and
``wheelctl``, which look for them, so both sides agree without importing each
other. An instance has a *name* (``--name``, ``$WHEELD_NAME``, default
``default``); everything else follows from it unless ``$WHEELD_SOCKET`` says
where the socket is.

**Names across users.** ``/dev/shm`` is shared by every uid, and a file there
can be renamed or removed only by its owner (and root). The instance lock
(``wheeld-NAME-lock``) is the one name all uids share: it says whether instance
NAME runs, and who runs it. The daemon's own segments (arena, client table,
secret) come in two spellings: the *plain* ones, ``wheeld-NAME-arena``, and the
*uid-qualified* ones of a uid U, ``wheeld-NAME-uidU-arena``. A daemon uses the
qualified ones when it already has them, or when a plain one belongs to another
uid (a root ``wheeld`` run by hand left its arena, say); else the plain ones
(:func:`wheeld.daemon.instance.choose_names`). The daemon holding the instance
lock says which spelling it uses (:mod:`wheeld.shm.instance_lock`), so
``wheelctl`` reads the arena of the daemon that runs, whoever that is.
"""

from __future__ import annotations

import os

DEFAULT_NAME = "default"
SYSTEM_SOCKET_DIR = "/run/wheeld"
SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared-memory names


def default_name() -> str:
    """``$WHEELD_NAME``, else ``default``."""
    return os.environ.get("WHEELD_NAME") or DEFAULT_NAME


def default_socket_path(name: str | None = None) -> str:
    """``$WHEELD_SOCKET``, else /run/wheeld/<name>.sock when that directory is writable
    (the systemd unit's RuntimeDirectory) or a daemon listens there, else
    $XDG_RUNTIME_DIR/wheeld-<name>.sock, else ~/.cache/wheeld/<name>.sock (never /tmp:
    PrivateTmp= would hide it). ``name`` defaults to :func:`default_name`."""
    env = os.environ.get("WHEELD_SOCKET")
    if env:
        return env
    name = name or default_name()
    system = os.path.join(SYSTEM_SOCKET_DIR, f"{name}.sock")
    if os.path.isdir(SYSTEM_SOCKET_DIR) and os.access(SYSTEM_SOCKET_DIR, os.W_OK | os.X_OK):
        return system
    if os.path.isdir(SYSTEM_SOCKET_DIR) and os.access(SYSTEM_SOCKET_DIR, os.X_OK) and os.path.exists(system):
        return system  # a system daemon runs: clients use its socket
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime) and os.access(runtime, os.W_OK):
        return os.path.join(runtime, f"wheeld-{name}.sock")
    return os.path.join(os.path.expanduser("~"), ".cache", "wheeld", f"{name}.sock")


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot name an instance, or None: it must be a non-empty file name
    part (no ``/``, no NUL, at most 200 bytes) that does not end like a uid qualifier
    (``-uid<digits>``: instance ``x-uid5`` would take the names of instance ``x``'s uid 5)."""
    if not name or "/" in name or "\0" in name or len(name.encode()) > 200:
        return "an instance name is 1 to 200 bytes without '/' or NUL"
    head, sep, digits = name.rpartition("-uid")
    if sep and head and digits.isdigit():
        return f"an instance name may not end in '-uid{digits}' (the uid-qualified names of instance {head!r})"
    return None


def _owner_tag(uid: int | None) -> str:
    return "" if uid is None else f"uid{int(uid)}-"


def arena_name(name: str, uid: int | None = None) -> str:
    """The arena's POSIX shared-memory name (``/dev/shm/wheeld-<name>-arena``; with
    ``uid``, the uid-qualified ``wheeld-<name>-uid<uid>-arena``)."""
    return f"/wheeld-{name}-{_owner_tag(uid)}arena"


def clients_name(name: str, uid: int | None = None) -> str:
    """The daemon's client table (``/dev/shm/wheeld-<name>-clients``; ``uid``: as for :func:`arena_name`)."""
    return f"/wheeld-{name}-{_owner_tag(uid)}clients"


def secret_name(name: str, uid: int | None = None) -> str:
    """The daemon's secret (``/dev/shm/wheeld-<name>-secret``, mode 0600: resume tokens
    are HMACs under it; ``uid``: as for :func:`arena_name`)."""
    return f"/wheeld-{name}-{_owner_tag(uid)}secret"


def segment_names(name: str, uid: int | None = None) -> tuple[str, str, str]:
    """(arena, client table, secret) in one spelling: plain (``uid`` None) or qualified."""
    return arena_name(name, uid), clients_name(name, uid), secret_name(name, uid)


def segment_prefix(name: str) -> str:
    """Label prefix of a client's ring (a memfd: it shows in /proc/PID/fd, not in /dev/shm)."""
    return f"wheeld-{name}-c"


def shm_prefix(name: str) -> str:
    """Every file the instance keeps in /dev/shm starts with this."""
    return f"wheeld-{name}-"


def lock_path(name: str, uid: int | None = None) -> str:
    """The instance lock (:mod:`wheeld.shm.instance_lock`): ``/dev/shm/wheeld-<name>-lock``,
    shared by every uid. With ``uid``: the lock a daemon of that uid takes instead when the
    shared one is another uid's file it may not even open (made by an older wheeld)."""
    return os.path.join(SHM_DIR, f"{shm_prefix(name)}{_owner_tag(uid)}lock")


def instance_entries(name: str, entries) -> list[str]:
    """Which of ``entries`` (names in /dev/shm) are files of instance ``name``: its lock,
    arena, client table and secret in either spelling, with what the daemon adds to them
    (``.new`` while an arena is built, ``.unusable-<ms>`` when one is set aside). Another
    instance whose name merely starts with ``name-`` is not matched."""
    prefix = shm_prefix(name)
    out = []
    for entry in entries:
        if not entry.startswith(prefix):
            continue
        rest = entry[len(prefix):]
        if rest.startswith("uid"):
            digits, dash, tail = rest[3:].partition("-")
            if digits.isdigit() and dash:
                rest = tail
        kind = rest.split(".", 1)[0]
        if kind in _KINDS:
            out.append(entry)
    return out


_KINDS = ("lock", "arena", "clients", "secret")


def shm_path(segment_name: str) -> str:
    """The file behind a POSIX shared-memory name (Linux keeps them in /dev/shm)."""
    return os.path.join(SHM_DIR, segment_name.lstrip("/"))
