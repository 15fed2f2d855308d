"""``wheeld``: run the daemon in the foreground (a thin click shell over ``server.run``).

Exit codes: 0 after a clean stop; 2 when it cannot start (a bad option, an
unknown user or group, a socket in use, a segment it may not use, a journal
directory it cannot read or write for a reason other than a full disk); 65
(``EX_DATAERR`` of sysexits.h) when ``--journal-damage refuse`` finds the
journal damaged, or when the journal holds timers a new arena cannot take
(nothing on disk changed; the unit's ``RestartPreventExitStatus=65`` stops
systemd from trying again); 75 (``EX_TEMPFAIL``) when another daemon runs the
instance, whatever its uid ("instance NAME is run by uid U, pid P"; nothing
changed: it may be tried again once that daemon stops). A refused start prints
one line on stderr and removes what it created.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys

import click

from wheeld.protocol import clients_layout as CL
from wheeld.protocol.errors import InvalidRequest, WheeldError
from wheeld.journal.recovery import DAMAGE_POLICIES, JournalDamaged
from wheeld.protocol.naming import default_name, default_socket_path, name_problem

from .config import MAX_CAPACITY, Config

#: the options' defaults are Config's (its field defaults), written once there
DEFAULTS = {f.name: f.default for f in dataclasses.fields(Config) if f.default is not dataclasses.MISSING}

#: a start refused for a bad option or a file it may not use
EXIT_CANNOT_START = 2
#: ``--journal-damage refuse`` found damage (sysexits.h: "the input data was incorrect").
EXIT_JOURNAL_DAMAGED = 65
#: another daemon runs the instance (sysexits.h EX_TEMPFAIL: "try again later")
EXIT_INSTANCE_RUNNING = 75


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--socket", "socket_path", envvar="WHEELD_SOCKET", default=None,
              help="Unix socket to listen on [env WHEELD_SOCKET; default /run/wheeld/NAME.sock if writable, "
                   "else $XDG_RUNTIME_DIR/wheeld-NAME.sock, else ~/.cache/wheeld/NAME.sock]")
@click.option("--name", envvar="WHEELD_NAME", default=None,
              help="Instance name; shared-memory segments are /wheeld-NAME-* [env WHEELD_NAME; default 'default']")
@click.option("--tick-ms", type=click.IntRange(1, 60_000), default=DEFAULTS["tick_ms"], show_default=True,
              help="Width of a level-0 bucket.")
@click.option("--wheel-size", type=click.IntRange(2, 1 << 16), default=DEFAULTS["wheel_size"], show_default=True,
              help="Buckets per level.")
@click.option("--capacity", type=click.IntRange(1, MAX_CAPACITY), default=DEFAULTS["capacity"], show_default=True,
              help="Timer records in the arena (64 bytes each). A new arena rebuilt from the journal is made "
                   "larger when the journal holds more timers (none is dropped); an existing arena keeps its own.")
@click.option("--ring-capacity", type=int, default=DEFAULTS["ring_capacity"], show_default=True,
              help="Commands per client ring (power of two).")
@click.option("--touch-capacity", type=int, default=DEFAULTS["touch_capacity"], show_default=True,
              help="Idle-timer touch slots per client.")
@click.option("--metrics", default=None, metavar="ADDR:PORT",
              help="Serve Prometheus metrics over HTTP (off by default).")
@click.option("--journal", "journal_dir", default=None, metavar="DIR",
              help="Write-ahead journal directory (off by default).")
@click.option("--fsync", default=DEFAULTS["fsync"], show_default=True, metavar="POLICY",
              help="always | interval=N (ms) | off")
@click.option("--journal-damage", type=click.Choice(DAMAGE_POLICIES), default=DEFAULTS["journal_damage"],
              show_default=True,
              help="When the arena is gone and is rebuilt from the journal: skip damaged journal lines (their "
                   "events are lost, each damaged range is logged as an error and counted in wheelctl stats) or "
                   f"refuse to start (exit {EXIT_JOURNAL_DAMAGED}, nothing on disk changed; see wheelctl check "
                   "--journal DIR).")
@click.option("--allow-uid", "allow_uids", multiple=True, metavar="USER",
              help="Allow this user (name or uid) to connect; repeatable. Without any --allow-*, anyone who can "
                   "open the socket may (the socket's mode and group decide). The daemon's own uid and root "
                   "always may.")
@click.option("--allow-group", "allow_groups", multiple=True, metavar="GROUP",
              help="Allow members of this group (name or gid; the peer's primary or supplementary groups) to "
                   "connect; repeatable.")
@click.option("--socket-mode", default=None, metavar="MODE",
              help="Mode of the socket wheeld binds (octal, as systemd's SocketMode=) [default 0660: the "
                   "daemon's user and the socket's group]. Not used with socket activation (wheeld.socket decides).")
@click.option("--socket-group", default=None, metavar="GROUP",
              help="Group of the socket wheeld binds (name or gid, as systemd's SocketGroup=; the daemon's user "
                   "must belong to it unless it is root) [default: the daemon's group]. With the default mode its "
                   "members may connect; --allow-uid/--allow-group still apply.")
@click.option("--monitor-group", default=None, metavar="GROUP",
              help="Members of this group may read the arena and the client table (wheelctl stats, dump, "
                   "groups, check); without it only the daemon's user and root can. The daemon must belong to it.")
@click.option("--group-owner", "group_owners", multiple=True, metavar="NAME=UID|@GROUP",
              help="Only this user (name or uid), or members of @GROUP, may join timer group NAME; repeatable. "
                   "A group not listed belongs to the first user that joins it.")
@click.option("--group-quota", type=click.IntRange(0, None), default=DEFAULTS["group_quota"], show_default=True,
              help="Timers (pending + fired, not yet acknowledged) one group may hold; more are refused with "
                   "QuotaExceeded, other groups are unaffected. 0: no limit.")
@click.option("--max-groups", type=click.IntRange(1, 65535), default=DEFAULTS["max_groups"], show_default=True,
              help="Group ids of a new arena (an existing arena keeps its own).")
@click.option("--groups-per-uid", type=click.IntRange(0, 65535), default=None,
              help="Groups one user may own (it owns the groups it was the first to join, while they are in use); "
                   "one more is refused with GroupLimit. Default: a quarter of the arena's group ids (256 of "
                   "1024); 0: no bound. Root and the daemon's own user have none.")
@click.option("--max-clients", type=click.IntRange(1, CL.MAX_CLIENTS), default=DEFAULTS["max_clients"],
              show_default=True,
              help="Client slots: clients connected, plus those that left without a Bye less than "
                   "--resume-grace-s ago.")
@click.option("--clients-per-uid", type=click.IntRange(0, CL.MAX_CLIENTS), default=None,
              help="Client slots one user may hold; one more is refused (BackPressure). Default: a quarter of "
                   "--max-clients (511 of 2047); 0: no bound. Root and the daemon's own user have none.")
@click.option("--resume-grace-s", type=click.FloatRange(0.0, 86_400.0), default=DEFAULTS["resume_grace_s"],
              show_default=True,
              help="How long the slot of a client that left without a Bye (or that has not come back since a "
                   "restart) waits for it; then its idle timers become plain timers at last touch + idle time "
                   "and the slot is freed.")
@click.option("--ack-timeout-s", type=click.FloatRange(1.0, 86_400.0), default=DEFAULTS["ack_timeout_s"],
              show_default=True,
              help="An expiration a client leaves unacknowledged this long is sent again (to any member of "
                   "its group) and counted; a client that has not read, this long after, what the daemon "
                   "queued for it is disconnected (however much it reads meanwhile).")
@click.option("--frame-timeout-s", type=click.FloatRange(0.1, 3600.0), default=DEFAULTS["frame_timeout_s"],
              show_default=True,
              help="A client that starts a message must finish it within this (else it is disconnected).")
@click.option("--coalesce-us", type=click.IntRange(0, 10_000), default=DEFAULTS["coalesce_us"], show_default=True,
              help="A parked daemon applies commands that nobody waits for at most this long after the "
                   "doorbell, gathering more of them per wake-up (0: at once). Flushes and full rings "
                   "wake it at once; a timer due sooner too.")
@click.option("--replicate", default=None, metavar="URL,URL,...",
              help="Send the journal to this NATS JetStream cluster (needs --journal; wheeld[fleet]): a stream "
                   "per host, its lease in a KV bucket. Credentials: WHEELD_NATS_USER/WHEELD_NATS_PASSWORD or "
                   "WHEELD_NATS_CREDS (a creds file), from the environment (docs/fleet.md).")
@click.option("--durability", type=click.Choice(["local", "replicated"]), default="local", show_default=True,
              help="replicated: flush() returns once the cluster stored (on a quorum) everything it covers, and "
                   "fails with ReplicationBehind after --replicate-timeout-s; local: as --fsync says.")
@click.option("--host-id", default=None, metavar="ID",
              help="This host's name in the fleet (its stream WHEELD_<ID>, its lease) [default: the host name].")
@click.option("--lease-ttl-s", type=click.FloatRange(1.0, 3600.0), default=10.0, show_default=True,
              help="A host whose lease is not renewed this long may be taken over by a peer (--adopt).")
@click.option("--replicas", type=click.IntRange(1, 5), default=3, show_default=True,
              help="Copies of the stream (and of the lease bucket) the cluster keeps.")
@click.option("--replicate-timeout-s", type=click.FloatRange(0.1, 3600.0), default=5.0, show_default=True,
              help="Under --durability replicated, a flush() the cluster has not stored this long fails.")
@click.option("--replicate-linger-ms", type=click.IntRange(0, 1000), default=10, show_default=True,
              help="Journal appends wait up to this long to go to the cluster in one message (a flush() under "
                   "--durability replicated sends at once); what a host loss may take beyond the local journal.")
@click.option("--adopt", "adopt", multiple=True, metavar="HOST|*",
              help="Take over this host's timers when its lease lapses (repeatable; '*': any host of the "
                   "fleet). Its timers go to the groups of the same names here.")
@click.option("--log-level", default="INFO", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
def main(socket_path, name, tick_ms, wheel_size, capacity, ring_capacity, touch_capacity, metrics, journal_dir, fsync,
         journal_damage, allow_uids, allow_groups, socket_mode, socket_group, monitor_group, group_owners, group_quota,
         max_groups, groups_per_uid, max_clients, clients_per_uid, resume_grace_s, ack_timeout_s, frame_timeout_s,
         coalesce_us, replicate, durability, host_id, lease_ttl_s, replicas, replicate_timeout_s, replicate_linger_ms,
         adopt, log_level):
    """Run the wheeld timer daemon in the foreground."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s wheeld[%(process)d] %(levelname)s %(message)s",
                        stream=sys.stderr)
    from .instance import AlreadyRunning
    from .recovery import TimersNotRestored

    name = name or default_name()
    try:
        if name_problem(name):
            raise InvalidRequest(f"--name {name!r}: {name_problem(name)}")
        config = Config(
            socket_path=socket_path or default_socket_path(name), name=name, tick_ms=tick_ms, wheel_size=wheel_size,
            capacity=capacity, ring_capacity=ring_capacity, touch_capacity=touch_capacity, metrics=metrics,
            journal_dir=journal_dir, fsync=fsync, journal_damage=journal_damage,
            coalesce_us=coalesce_us,
            allowed_uids=_ids("--allow-uid", allow_uids, _uid) if allow_uids or allow_groups else None,
            allowed_gids=_ids("--allow-group", allow_groups, _gid) if allow_uids or allow_groups else None,
            socket_mode=_mode("--socket-mode", socket_mode) if socket_mode is not None else None,
            socket_gid=_one_id("--socket-group", socket_group, _gid) if socket_group is not None else None,
            monitor_gid=_one_id("--monitor-group", monitor_group, _gid) if monitor_group else None,
            arena_mode=0o640 if monitor_group else 0o600,
            group_owners=tuple(_group_owner(spec) for spec in group_owners),
            group_quota=group_quota, max_groups=max_groups, ack_timeout_s=ack_timeout_s,
            frame_timeout_s=frame_timeout_s, groups_per_uid=groups_per_uid, max_clients=max_clients,
            clients_per_uid=clients_per_uid, resume_grace_s=resume_grace_s,
            fleet=_fleet(replicate, journal_dir, host_id, lease_ttl_s, replicas, adopt, replicate_linger_ms),
            durability=durability, replicate_timeout_s=replicate_timeout_s,
        )
        if durability == "replicated" and config.fleet is None:
            raise InvalidRequest("--durability replicated needs --replicate")
        from .server import run

        sys.exit(run(config))
    except (JournalDamaged, TimersNotRestored) as exc:
        click.echo(f"wheeld: {exc}", err=True)
        sys.exit(EXIT_JOURNAL_DAMAGED)
    except AlreadyRunning as exc:
        click.echo(f"wheeld: {exc}", err=True)
        sys.exit(EXIT_INSTANCE_RUNNING)
    except WheeldError as exc:
        click.echo(f"wheeld: {exc}", err=True)
        sys.exit(EXIT_CANNOT_START)


def _fleet(replicate, journal_dir, host_id, lease_ttl_s, replicas, adopt, linger_ms=10):
    """The FleetConfig of ``--replicate`` (None without it)."""
    if not replicate:
        if adopt:
            raise InvalidRequest("--adopt needs --replicate")
        return None
    if not journal_dir:
        raise InvalidRequest("--replicate needs --journal (the stream is a copy of the journal)")
    from wheeld.fleet import stream
    from wheeld.fleet.replicator import FleetConfig

    urls = tuple(u.strip() for u in replicate.split(",") if u.strip())
    try:
        host = stream.check_host_id(host_id) if host_id else stream.default_host_id()
        adopted = tuple(a if a == "*" else stream.check_host_id(a) for a in adopt)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    env = os.environ
    return FleetConfig(urls=urls, host_id=host, lease_ttl_s=lease_ttl_s, replicas=replicas,
                       user=env.get("WHEELD_NATS_USER"), password=env.get("WHEELD_NATS_PASSWORD"),
                       creds=env.get("WHEELD_NATS_CREDS"), adopt=adopted, linger_ms=linger_ms)


def _uid(name: str) -> int:
    import pwd

    return int(name) if name.isdigit() else pwd.getpwnam(name).pw_uid


def _gid(name: str) -> int:
    import grp

    return int(name) if name.isdigit() else grp.getgrnam(name).gr_gid


def _group_owner(spec: str) -> tuple[str, str, int]:
    """``NAME=UID`` or ``NAME=@GROUP`` -> (name, "uid"|"gid", id)."""
    name, sep, owner = spec.partition("=")
    if not sep or not name or not owner:
        raise InvalidRequest(f"--group-owner: {spec!r}: expected NAME=USER or NAME=@GROUP")
    if owner.startswith("@"):
        return name, "gid", _one_id("--group-owner", owner[1:], _gid)
    return name, "uid", _one_id("--group-owner", owner, _uid)


def _ids(option: str, names, resolve) -> frozenset[int]:
    """Users or groups by name or number; an unknown one is a one-line error naming the option."""
    return frozenset(_one_id(option, n, resolve) for n in names)


def _one_id(option: str, name: str, resolve) -> int:
    try:
        return resolve(name)
    except KeyError:
        kind = "group" if resolve is _gid else "user"
        raise InvalidRequest(f"{option}: unknown {kind} {name!r}") from None


def _mode(option: str, text: str) -> int:
    """An access mode in octal (``0660``, ``660``), at most 0777."""
    digits = text[2:] if text.lower().startswith("0o") else text
    if not digits or len(digits) > 4 or any(c not in "01234567" for c in digits) or int(digits, 8) > 0o777:
        raise InvalidRequest(f"{option}: {text!r} is not an octal access mode between 0000 and 0777")
    return int(digits, 8)


if __name__ == "__main__":
    main()
