"""``wheeld``: run the daemon in the foreground (a thin click shell over ``server.run``).

Exit codes: 0 after a clean stop; 2 when it cannot start (a bad option, a
socket in use, an arena it cannot use); 65 (``EX_DATAERR`` of sysexits.h)
when ``--journal-damage refuse`` finds the journal damaged (nothing on disk
changed; the unit's ``RestartPreventExitStatus=65`` stops systemd from trying
again).
"""

from __future__ import annotations

import logging
import sys

import click

from wheeld.protocol import clients_layout as CL
from wheeld.protocol.errors import WheeldError
from wheeld.protocol.journal_recovery import DAMAGE_POLICIES, JournalDamaged
from wheeld.protocol.naming import default_name, default_socket_path

from .config import Config

#: ``--journal-damage refuse`` found damage (sysexits.h: "the input data was incorrect").
EXIT_JOURNAL_DAMAGED = 65


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--socket", "socket_path", envvar="WHEELD_SOCKET", default=None,
              help="Unix socket to listen on [env WHEELD_SOCKET; default /run/wheeld/NAME.sock if writable, "
                   "else $XDG_RUNTIME_DIR/wheeld-NAME.sock, else ~/.cache/wheeld/NAME.sock]")
@click.option("--name", envvar="WHEELD_NAME", default=None,
              help="Instance name; shared-memory segments are /wheeld-NAME-* [env WHEELD_NAME; default 'default']")
@click.option("--tick-ms", type=click.IntRange(1, 60_000), default=1, show_default=True, help="Width of a level-0 bucket.")
@click.option("--wheel-size", type=click.IntRange(2, 1 << 16), default=256, show_default=True, help="Buckets per level.")
@click.option("--capacity", type=click.IntRange(1, (1 << 31) - 100_000), default=1_000_000, show_default=True,
              help="Timer records in the arena (64 bytes each).")
@click.option("--ring-capacity", type=int, default=1 << 14, show_default=True, help="Commands per client ring (power of two).")
@click.option("--touch-capacity", type=int, default=1 << 17, show_default=True, help="Idle-timer touch slots per client.")
@click.option("--metrics", default=None, metavar="ADDR:PORT", help="Serve Prometheus metrics over HTTP (off by default).")
@click.option("--journal", "journal_dir", default=None, metavar="DIR", help="Write-ahead journal directory (off by default).")
@click.option("--fsync", default="interval=10", show_default=True, metavar="POLICY", help="always | interval=N (ms) | off")
@click.option("--journal-damage", type=click.Choice(DAMAGE_POLICIES), default="skip", show_default=True,
              help="When the arena is gone and is rebuilt from the journal: skip damaged journal lines (their "
                   "events are lost, each damaged range is logged as an error and counted in wheelctl stats) or "
                   f"refuse to start (exit {EXIT_JOURNAL_DAMAGED}, nothing on disk changed; see wheelctl check "
                   "--journal DIR).")
@click.option("--allow-uid", "allow_uids", multiple=True, metavar="USER",
              help="Allow this user (name or uid) to connect; repeatable. Without any --allow-*, anyone who can "
                   "open the socket may (the socket's mode and group decide). The daemon's own uid and root always may.")
@click.option("--allow-group", "allow_groups", multiple=True, metavar="GROUP",
              help="Allow members of this group (name or gid; the peer's primary or supplementary groups) to "
                   "connect; repeatable.")
@click.option("--monitor-group", default=None, metavar="GROUP",
              help="Members of this group may read the arena and the client table (wheelctl stats, dump, "
                   "groups, check); without it only the daemon's user and root can. The daemon must belong to it.")
@click.option("--group-owner", "group_owners", multiple=True, metavar="NAME=UID|@GROUP",
              help="Only this user (name or uid), or members of @GROUP, may join timer group NAME; repeatable. "
                   "A group not listed belongs to the first user that joins it.")
@click.option("--group-quota", type=click.IntRange(0, None), default=0, show_default=True,
              help="Timers (pending + fired, not yet acknowledged) one group may hold; more are refused with "
                   "QuotaExceeded, other groups are unaffected. 0: no limit.")
@click.option("--max-groups", type=click.IntRange(1, 65535), default=1024, show_default=True,
              help="Group ids of a new arena (an existing arena keeps its own).")
@click.option("--groups-per-uid", type=click.IntRange(0, 65535), default=None,
              help="Groups one user may own (it owns the groups it was the first to join, while they are in use); "
                   "one more is refused with GroupLimit. Default: a quarter of the arena's group ids (256 of "
                   "1024); 0: no bound. Root and the daemon's own user have none.")
@click.option("--max-clients", type=click.IntRange(1, CL.MAX_CLIENTS), default=CL.MAX_CLIENTS, show_default=True,
              help="Client slots: clients connected, plus those that left without a Bye less than "
                   "--resume-grace-s ago.")
@click.option("--clients-per-uid", type=click.IntRange(0, CL.MAX_CLIENTS), default=None,
              help="Client slots one user may hold; one more is refused (BackPressure). Default: a quarter of "
                   "--max-clients (511 of 2047); 0: no bound. Root and the daemon's own user have none.")
@click.option("--resume-grace-s", type=click.FloatRange(0.0, 86_400.0), default=60.0, show_default=True,
              help="How long the slot of a client that left without a Bye (or that has not come back since a "
                   "restart) waits for it; then its idle timers become plain timers at last touch + idle time "
                   "and the slot is freed.")
@click.option("--ack-timeout-s", type=click.FloatRange(1.0, 86_400.0), default=30.0, show_default=True,
              help="An expiration a client leaves unacknowledged this long is sent again (to any member of "
                   "its group) and counted; a client that has not read, this long after, what the daemon "
                   "queued for it is disconnected (however much it reads meanwhile).")
@click.option("--frame-timeout-s", type=click.FloatRange(0.1, 3600.0), default=5.0, show_default=True,
              help="A client that starts a message must finish it within this (else it is disconnected).")
@click.option("--coalesce-us", type=click.IntRange(0, 10_000), default=500, show_default=True,
              help="A parked daemon applies commands that nobody waits for at most this long after the "
                   "doorbell, gathering more of them per wake-up (0: at once). Flushes and full rings "
                   "wake it at once; a timer due sooner too.")
@click.option("--log-level", default="INFO", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
def main(socket_path, name, tick_ms, wheel_size, capacity, ring_capacity, touch_capacity, metrics, journal_dir, fsync,
         journal_damage, allow_uids, allow_groups, monitor_group, group_owners, group_quota, max_groups,
         groups_per_uid, max_clients, clients_per_uid, resume_grace_s, ack_timeout_s, frame_timeout_s, coalesce_us,
         log_level):
    """Run the wheeld timer daemon in the foreground."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s wheeld[%(process)d] %(levelname)s %(message)s",
                        stream=sys.stderr)
    name = name or default_name()
    config = Config(
        socket_path=socket_path or default_socket_path(name), name=name, tick_ms=tick_ms, wheel_size=wheel_size,
        capacity=capacity, ring_capacity=ring_capacity, touch_capacity=touch_capacity, metrics=metrics,
        journal_dir=journal_dir, fsync=fsync, journal_damage=journal_damage, log_level=log_level,
        coalesce_us=coalesce_us,
        allowed_uids=_ids(allow_uids, _uid) if allow_uids or allow_groups else None,
        allowed_gids=_ids(allow_groups, _gid) if allow_uids or allow_groups else None,
        monitor_gid=next(iter(_ids([monitor_group], _gid))) if monitor_group else None,
        arena_mode=0o640 if monitor_group else 0o600,
        group_owners=tuple(_group_owner(spec) for spec in group_owners),
        group_quota=group_quota, max_groups=max_groups, ack_timeout_s=ack_timeout_s, frame_timeout_s=frame_timeout_s,
        groups_per_uid=groups_per_uid, max_clients=max_clients, clients_per_uid=clients_per_uid,
        resume_grace_s=resume_grace_s,
    )
    from .server import run

    try:
        sys.exit(run(config))
    except JournalDamaged as exc:
        click.echo(f"wheeld: {exc}", err=True)
        sys.exit(EXIT_JOURNAL_DAMAGED)
    except WheeldError as exc:
        click.echo(f"wheeld: {exc}", err=True)
        sys.exit(2)


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
        raise click.BadParameter(f"{spec!r}: expected NAME=USER or NAME=@GROUP", param_hint="--group-owner")
    if owner.startswith("@"):
        return name, "gid", next(iter(_ids([owner[1:]], _gid)))
    return name, "uid", next(iter(_ids([owner], _uid)))


def _ids(names, resolve) -> frozenset[int]:
    try:
        return frozenset(resolve(n) for n in names)
    except KeyError as exc:
        raise click.BadParameter(f"unknown user or group {exc}") from None


if __name__ == "__main__":
    main()
