"""``wheelctl``: look at a running wheeld and poke it (a click group).

Two kinds of subcommands:

* **Readers** (``stats``, ``dump``, ``groups``, ``check``) map the daemon's arena
  read-only and never talk to the daemon (:mod:`wheeld.shm.reader`). They
  answer when the daemon is stuck or dead, and they cannot disturb it.
* **Clients** (``add``, ``cancel``, ``tail``) connect to the socket like any
  worker, as a member of ``--group``. They need a live daemon.

``cancel`` semantics. The client library's ``cancel()`` answers only for the
caller's own armings, which a fresh ``wheelctl`` process never has. So
``wheelctl cancel`` looks the key up in the arena before sending the cancel,
flushes, and looks again: exit 0 when a pending timer of that key existed and
is gone (the daemon removed it), exit 1 when there was none or it expired
first. With an arena it may not read, it cannot tell, says so and exits 0.

``add``/``cancel`` are group members for the moment they are connected; an
expiration of the group the daemon hands them meanwhile is not acknowledged,
so it goes back to the group when they leave. ``tail`` is a member for as long
as it runs and *takes* the group's expirations (printing them): run it on a
group no worker consumes, or it steals their expirations.

``check --journal DIR`` reads a journal directory instead of the arena (no
daemon needed, nothing written): every damaged range with its file, byte
offsets, line numbers and what recovery would lose or keep; exit 1 when there
is any (a torn tail alone, which recovery cuts like after any crash, is not
damage).

Exit codes (also in ``wheelctl --help``)::

    0  ok
    1  check failed (the arena broken; with --journal, a damaged journal); cancel
       found nothing to cancel; a command was refused
    2  usage error
    3  no daemon or no arena (nothing listens on the socket, no arena of that name,
       or not allowed to use them); stats also when the daemon process is gone
    4  the daemon does not respond (stats: heartbeat stale; clients: no answer in --timeout)
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import stat
import sys
import time

import click

from wheeld.protocol import arena_layout as AL
from wheeld.protocol.errors import (
    ArenaFull,
    BrokenPeer,
    CorruptArena,
    DaemonNotRunning,
    InvalidDelay,
    InvalidRequest,
    NotAllowed,
    WheeldError,
)
from wheeld.protocol.keys import Key, encode_key
from wheeld.shm.instance_lock import reader_segments
from wheeld.protocol.naming import SHM_DIR, default_name, default_socket_path
from wheeld.shm import check as CK
from wheeld.shm import reader as R
from wheeld.shm import snapshot as SN

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_NO_DAEMON = 3
EXIT_NOT_RESPONDING = 4

EXIT_CODES_HELP = """\b
Exit codes:
  0  ok
  1  check failed (the arena is broken; check --journal: the journal has
     damaged ranges), cancel found no pending timer, or a command was refused
  2  usage error
  3  no daemon or no arena (or not allowed to use them); stats: the daemon
     process is gone (the figures it left in the arena are still printed)
  4  the daemon does not respond (stats: its loop has not published for
     --stale-after seconds; add/cancel/tail: no answer within --timeout)

\b
Readers (stats, dump, groups, check) map the arena read-only and never talk
to the daemon; add, cancel and tail connect to the socket as a group member."""


class CtlError(click.ClickException):
    """A failure with the exit code a script can rely on."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code  # type: ignore[misc]  # click declares a ClassVar; each CtlError has its own

    def show(self, file=None) -> None:
        click.echo(f"wheelctl: {self.message}", err=True)


class Ctl:
    """What the group's options resolved to."""

    def __init__(self, name: str, socket_path: str, timeout_s: float):
        self.name = name
        self.socket_path = socket_path
        self.timeout_s = timeout_s

    def reader(self) -> R.ArenaReader:
        try:
            return R.ArenaReader(self.name)
        except R.NoArena as exc:
            raise CtlError(str(exc), EXIT_NO_DAEMON) from None
        except CorruptArena as exc:
            raise CtlError(f"{reader_segments(self.name)[0]}: {exc}", EXIT_FAILED) from None

    def optional_reader(self) -> R.ArenaReader | None:
        try:
            return R.ArenaReader(self.name)
        except (R.NoArena, CorruptArena):
            return None

    def probe(self) -> None:
        """Fail fast with exit 3 when nothing listens on the socket (the client library would retry)."""
        path = self.socket_path
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            raise CtlError(f"no wheeld socket at {path}: is wheeld running (wheeld --socket {path})?",
                           EXIT_NO_DAEMON) from None
        except PermissionError:
            raise CtlError(f"may not reach {path}: permission denied (join the daemon's client group)",
                           EXIT_NO_DAEMON) from None
        if not stat.S_ISSOCK(mode):
            raise CtlError(f"{path} is not a socket", EXIT_NO_DAEMON)
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(self.timeout_s)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            raise CtlError(f"nothing listens on {path} (a socket left by a daemon that is gone)",
                           EXIT_NO_DAEMON) from None
        except PermissionError:
            raise CtlError(f"may not connect to {path}: permission denied ({_join_hint(mode, path)})",
                           EXIT_NO_DAEMON) from None
        except (TimeoutError, socket.timeout, BlockingIOError):
            raise CtlError(f"wheeld at {path} does not accept connections (backlog full)",
                           EXIT_NOT_RESPONDING) from None
        finally:
            probe.close()

    def connect(self, group: str):
        import wheeld

        self.probe()
        try:
            return wheeld.connect(self.socket_path, group=group, connect_timeout_s=self.timeout_s,
                                  reconnect_timeout_s=self.timeout_s, ring_timeout_s=self.timeout_s,
                                  client_name="wheelctl")
        except (NotAllowed, DaemonNotRunning) as exc:
            raise CtlError(str(exc), EXIT_NO_DAEMON) from None
        except (BrokenPeer, TimeoutError) as exc:
            raise CtlError(f"wheeld at {self.socket_path} does not respond within {self.timeout_s:g} s ({exc})",
                           EXIT_NOT_RESPONDING) from None
        except InvalidRequest as exc:
            raise CtlError(str(exc), EXIT_USAGE) from None
        except WheeldError as exc:
            raise CtlError(str(exc), EXIT_FAILED) from None


def _join_hint(mode: int, path: str) -> str:
    """Which group lets this user connect to the socket at ``path``, when its mode lets a group in."""
    import grp

    if not mode & 0o020:
        return "the socket lets no group in: ask for a wider --socket-mode"
    gid = os.stat(path).st_gid
    try:
        return f"join the group {grp.getgrgid(gid).gr_name!r} that owns it, then log in again"
    except KeyError:
        return f"join the group {gid} that owns it, then log in again"


@contextlib.contextmanager
def _daemon_errors(ctl: Ctl):
    """Turn what a client call raises into the documented exit codes."""
    try:
        yield
    except CtlError:
        raise
    except TimeoutError as exc:
        raise CtlError(f"wheeld at {ctl.socket_path} did not apply the command within {ctl.timeout_s:g} s ({exc})",
                       EXIT_NOT_RESPONDING) from None
    except ArenaFull as exc:
        raise CtlError(f"refused: {exc}", EXIT_FAILED) from None
    except InvalidRequest as exc:
        raise CtlError(f"refused: {exc}", EXIT_FAILED) from None
    except BrokenPeer as exc:
        raise CtlError(f"lost wheeld at {ctl.socket_path}: {exc}", EXIT_NO_DAEMON) from None
    except WheeldError as exc:
        raise CtlError(str(exc), EXIT_FAILED) from None


def _interrupt(_signum, _frame) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def _until_interrupted():
    """SIGINT (Ctrl-C) and SIGTERM end a long-running command the same way, with
    KeyboardInterrupt, even when wheelctl was started with SIGINT ignored (a
    background job of a non-interactive shell): it then stops cleanly, flushing
    its output and acknowledging what it printed. The previous handlers come back
    on exit."""
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _leave(client) -> None:
    """Close a short-lived client: the library acknowledges only expirations it handed
    out, so whatever add/cancel received unread goes back to the group."""
    client.close()


def _parse_key(key: str, key_type: str) -> Key:
    """The user's key as the type asked for; a key wheeld cannot store is a usage error (exit 2)."""
    value: Key
    if key_type == "int":
        try:
            value = int(key, 0)
        except ValueError:
            raise click.BadParameter(f"{key!r} is not an integer", param_hint="KEY") from None
    elif key_type == "bytes":
        try:
            value = bytes.fromhex(key)
        except ValueError:
            raise click.BadParameter(f"{key!r} is not hex (bytes keys are given in hex)", param_hint="KEY") from None
    else:
        value = key
    try:
        encode_key(value)
    except InvalidRequest as exc:
        raise click.BadParameter(str(exc), param_hint="KEY") from None
    return value


def _show_key(key) -> str:
    return f"0x{key.hex()} (bytes)" if type(key) is bytes else f"{key} (int)" if type(key) is int else repr(key)


_NEGATIVE_INT = re.compile(r"-[0-9]+")


class _SignedArguments(click.Command):
    """A command whose arguments may be negative integers (``add k -5``, ``--key-type int
    cancel -3``), which click would otherwise take for unknown options ("No such option
    '-5'"). Only when every other token that looks like an option is one of the command's
    own is the line parsed again with unknown options left to the arguments, so a
    mistyped option is still refused as one."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, list(args))
        except click.NoSuchOption:
            known = {opt for param in self.get_params(ctx) for opt in (*param.opts, *param.secondary_opts)}
            tokens = args[:args.index("--")] if "--" in args else args
            for token in tokens:
                if token.startswith("-") and len(token) > 1 and not _NEGATIVE_INT.fullmatch(token) \
                        and token.split("=", 1)[0] not in known and (token.startswith("--") or token[:2] not in known):
                    raise click.NoSuchOption(token, ctx=ctx) from None
            if not any(_NEGATIVE_INT.fullmatch(token) for token in tokens):
                raise
        ctx.ignore_unknown_options = True
        return super().parse_args(ctx, list(args))


_key_type_option = click.option("--key-type", type=click.Choice(["str", "int", "bytes"]), default="str",
                                show_default=True, help="str and int keys are different keys; bytes are given in hex.")
_group_option = click.option("--group", "-g", default="default", show_default=True, metavar="G",
                             help="The group the timer belongs to (keys are scoped by group).")


# ---------------------------------------------------------------------------- the group
@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
             epilog=EXIT_CODES_HELP)
@click.option("--socket", "socket_path", envvar="WHEELD_SOCKET", default=None, metavar="PATH",
              help="The daemon's socket [env WHEELD_SOCKET; default as for wheeld: /run/wheeld/NAME.sock, "
                   "$XDG_RUNTIME_DIR/wheeld-NAME.sock or ~/.cache/wheeld/NAME.sock].")
@click.option("--name", envvar="WHEELD_NAME", default=None,
              help="The daemon's instance name; its arena is /wheeld-NAME-arena [env WHEELD_NAME; default 'default'].")
@click.option("--timeout", "timeout_s", type=click.FloatRange(0.1, 3600), default=5.0, show_default=True,
              metavar="SECONDS", help="How long add/cancel/tail wait for the daemon to answer.")
@click.pass_context
def main(ctx: click.Context, socket_path: str | None, name: str | None, timeout_s: float) -> None:
    """Look at a running wheeld (stats, dump, groups, check) and poke it (add, cancel, tail)."""
    name = name or default_name()
    ctx.obj = Ctl(name, socket_path or default_socket_path(name), timeout_s)


# ---------------------------------------------------------------------------- stats
def _fmt_int(value) -> str:
    return "?" if value is None else f"{value:,}"


def _fmt_ms(ms) -> str:
    if ms is None:
        return "?"
    if ms < 1000:
        return f"{ms:.0f} ms"
    s = ms / 1000
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{int(s // 60)} min {int(s % 60)} s"
    if s < 86400:
        return f"{int(s // 3600)} h {int(s % 3600 // 60)} min"
    return f"{int(s // 86400)} d {int(s % 86400 // 3600)} h"


def _fmt_us(us) -> str:
    if us is None:
        return "-"
    if us < 1000:
        return f"{us / 1000:.3f} ms"
    if us < 1_000_000:
        return f"{us / 1000:.1f} ms"
    return f"{us / 1e6:.1f} s"


def _fmt_rate(rate) -> str:
    if rate is None:
        return ""
    return f"{rate:,.1f}/s"


def render_table(snap: SN.Snapshot, rate: dict[str, float] | None) -> str:
    """``wheelctl stats``: the daemon and its arena, the timers, lateness, clients and groups."""
    return "\n".join([
        *_daemon_lines(snap), "", *_timer_lines(snap, rate), "", *_lateness_lines(snap), "", *_client_lines(snap),
    ])  # fmt: skip


def _daemon_lines(snap: SN.Snapshot) -> list[str]:
    c = snap.counters
    state = {"ok": "ok", "stuck": "NOT RESPONDING", "down": "NOT RUNNING"}[snap.health]
    pid = snap.daemon_pid
    daemon = (f"pid {pid} {'alive' if snap.daemon_alive else 'gone'}" if pid > 0
              else "no daemon (stopped cleanly or never published)")
    lines = [f"wheeld {snap.name!r}: {state}   {daemon}, heartbeat {_fmt_ms(snap.heartbeat_age_ms)} ago, "
             f"up {_fmt_ms(snap.uptime_ms)}, restarts {c['daemon_restarts_total']}, "
             f"hot path {snap.hot_path or 'unknown'}"]
    use = snap.used / snap.capacity * 100 if snap.capacity else 0.0
    lines.append(f"arena  {snap.segment}  {snap.arena_bytes / 1e6:.1f} MB, capacity {_fmt_int(snap.capacity)} timers, "
                 f"used {_fmt_int(snap.used)} ({use:.1f} %), tick {snap.tick_ms} ms, "
                 f"{snap.wheel_size} buckets x {snap.levels} levels")
    ranges, damaged = c["journal_damaged_ranges_total"], c["journal_damaged_lines_total"]
    if ranges:
        lines.append(f"journal  DAMAGED: the recovery that built this arena skipped {_fmt_int(ranges)} damaged "
                     f"range{'s' if ranges != 1 else ''} ({_fmt_int(damaged)} line{'s' if damaged != 1 else ''}) of "
                     f"the journal; their events are lost (the daemon's log lists them; wheelctl check --journal DIR)")
    stalled = c["journal_stalled"]
    if stalled:
        import errno
        import os

        lines.append(f"journal  NOT WRITABLE: {os.strerror(stalled)} ({errno.errorcode.get(stalled, stalled)}); "
                     f"timers fire, every flush() fails with JournalUnavailable until it can be written again "
                     f"({_fmt_int(c['journal_unwritten_events_total'])} events not written, "
                     f"{_fmt_int(c['journal_flushes_refused_total'])} flushes refused so far)")
    elif c["journal_stalls_total"]:
        lines.append(f"journal  writable; it was not {_fmt_int(c['journal_stalls_total'])} time(s) "
                     f"({_fmt_int(c['journal_flushes_refused_total'])} flushes refused)")
    fleet_code = c["fleet_state"]
    if fleet_code:
        from wheeld.protocol.arena_layout import FLEET_STATES

        name = FLEET_STATES[fleet_code] if 0 <= fleet_code < len(FLEET_STATES) else f"state {fleet_code}"
        lines.append(f"fleet  {name.upper() if name in ('fenced', 'failed') else name}: "
                     f"{_fmt_int(c['fleet_lag_records'])} journal events not stored by the cluster yet"
                     f"{', oldest waiting ' + _fmt_ms(c['fleet_lag_ms']) if c['fleet_lag_records'] else ''} "
                     f"(wheelctl fleet shows the hosts and their leases)")
    return lines


def _timer_lines(snap: SN.Snapshot, rate: dict[str, float] | None) -> list[str]:
    c = snap.counters
    width = 24
    lines = [f"{'timers':<{width}}{'total':>14}  {'rate':>12}", f"{'  pending':<{width}}{_fmt_int(c['pending']):>14}"]
    for level, count in snap.pending_by_level.items():
        label = "    due" if level == "due" else f"    level {level}"
        lines.append(f"{label:<{width}}{_fmt_int(count):>14}")
    for name in SN.RATE_COUNTERS:
        value = rate.get(name) if rate else None
        lines.append(f"{'  ' + name:<{width}}{_fmt_int(c[name]):>14}  {_fmt_rate(value):>12}")
    lines.append(f"{'  undelivered':<{width}}{_fmt_int(snap.undelivered):>14}  "
                 "(fired, waiting for a live group member)")
    lines.append(f"{'  unacknowledged':<{width}}{_fmt_int(snap.unacknowledged):>14}  (sent, not acknowledged yet)")
    return lines


def _lateness_lines(snap: SN.Snapshot) -> list[str]:
    n = snap.lateness_count
    q = snap.lateness_quantiles()
    mean = snap.lateness_sum_us / n if n else None
    top = ">" if snap.lateness_counts[-1] else "<="
    lines = [f"lateness (expiration - deadline), {_fmt_int(n)} expirations: p50 {_fmt_us(q['p50_us'])}, "
             f"p99 {_fmt_us(q['p99_us'])}, p99.9 {_fmt_us(q['p999_us'])}, "
             f"max {top} {_fmt_us(q['max_us'])}, mean {_fmt_us(mean)}"]
    counts = snap.lateness_counts
    highest = max((i for i, k in enumerate(counts) if k), default=-1)
    peak = max(counts) or 1
    for i in range(highest + 1):
        bound = f"< {_fmt_us(AL.LATENESS_BOUNDS_US[i])}" if i < len(AL.LATENESS_BOUNDS_US) else \
            f">= {_fmt_us(AL.LATENESS_BOUNDS_US[-1])}"
        bar = "#" * max(1 if counts[i] else 0, round(40 * counts[i] / peak))
        lines.append(f"  {bound:>12} {_fmt_int(counts[i]):>12}  {bar}")
    return lines


def _client_lines(snap: SN.Snapshot) -> list[str]:
    c = snap.counters
    lines = [f"clients  {c['clients_connected']} connected (accepted {c['clients_total']}, refused "
             f"{c['clients_refused_total']}, dropped {c['clients_dropped_total']})"]
    if snap.rings is None:
        lines.append(f"rings    ? (the client table is not readable), full events {c['ring_full_total']}")
    else:
        lines.append(f"rings    {len(snap.rings)}, depth {_fmt_int(snap.ring_depth)}, "
                     f"full events {c['ring_full_total']}")
        if snap.rings:
            lines.append(f"  {'slot':>5}  {'group':<20} {'pid':>8}  {'depth':>15}  client")
            for r in snap.rings:
                fill = f"{_fmt_int(r.depth)}/{_fmt_int(r.capacity)}"
                lines.append(f"  {r.slot:>5}  {r.group:<20} {r.pid:>8}  {fill:>15}  "
                             f"{'alive' if r.client_alive else 'gone'}")
    lines.append(f"groups   {c['groups_active']} active, {_groups_in_use(snap)}")
    lines.append(_groups_table(snap.groups, indent="  "))
    return lines


def _groups_in_use(snap: SN.Snapshot) -> str:
    return f"{_fmt_int(snap.groups_in_use)} of {_fmt_int(snap.max_groups)} group ids in use"


def _groups_table(groups, indent: str = "") -> str:
    """One row per group id in use: live records (pending + fired), pending, fired, live client slots."""
    lines = [f"{indent}{'id':>5}  {'group':<24} {'live':>12} {'pending':>12} {'fired':>10} {'clients':>8}"]
    for g in groups:
        lines.append(f"{indent}{g.id:>5}  {g.name or '(no name)':<24} {_fmt_int(g.live):>12} "
                     f"{_fmt_int(g.pending):>12} {_fmt_int(g.fired):>10} {g.clients:>8}")
    return "\n".join(lines)


def _sample(ctl: Ctl, stale_after_s: float) -> SN.Snapshot:
    with ctl.reader() as reader:
        return reader.snapshot(stale_after_s=stale_after_s)


def _emit(snap: SN.Snapshot, rate, as_json: bool, prometheus: bool, compact: bool = False) -> None:
    if prometheus:
        from wheeld.shm.prometheus import render

        click.echo(render(snap), nl=False)
    elif as_json:
        click.echo(json.dumps(snap.to_dict(rate), separators=(",", ":") if compact else None,
                              indent=None if compact else 2))
    else:
        click.echo(render_table(snap, rate))


def _health_exit(snap: SN.Snapshot) -> None:
    if snap.health == "down":
        pid = snap.daemon_pid
        who = f"wheeld (pid {pid}) is not running" if pid > 0 else "no wheeld is running"
        raise CtlError(f"{who}: the figures are what it left in {snap.segment}", EXIT_NO_DAEMON)
    if snap.health == "stuck":
        raise CtlError(f"wheeld (pid {snap.daemon_pid}) does not respond: its loop last published "
                       f"{_fmt_ms(snap.heartbeat_age_ms)} ago", EXIT_NOT_RESPONDING)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="One JSON document (with --watch: one per line).")
@click.option("--prometheus", is_flag=True, help="Prometheus text exposition (the same as wheeld --metrics serves).")
@click.option("--watch", type=click.FloatRange(0.1, 3600), default=None, metavar="SECONDS",
              help="Redraw every SECONDS until Ctrl-C or SIGTERM (exits 0).")
@click.option("--interval", type=click.FloatRange(0, 60), default=1.0, show_default=True, metavar="SECONDS",
              help="Time between the two samples the rates come from; 0: no rates.")
@click.option("--stale-after", type=click.FloatRange(0.01, 3600), default=SN.DEFAULT_STALE_AFTER_S,
              show_default=True, metavar="SECONDS",
              help="A daemon whose loop has not published for this long counts as not responding (exit 4).")
@click.pass_obj
def stats(ctl: Ctl, as_json: bool, prometheus: bool, watch: float | None, interval: float, stale_after: float) -> None:
    """Counters, rates, lateness, rings, clients, groups, arena use, daemon health.

    Read from the arena, never from the daemon: it answers when the daemon is
    stuck or dead (and then exits 4 or 3 after printing).
    """
    if as_json and prometheus:
        raise click.UsageError("--json and --prometheus exclude each other")
    if watch is None:
        first = _sample(ctl, stale_after)
        rate = None
        snap = first
        if interval > 0:
            time.sleep(interval)
            snap = _sample(ctl, stale_after)
            rate = SN.rates(first, snap)
        _emit(snap, rate, as_json, prometheus)
        _health_exit(snap)
        return
    clear = sys.stdout.isatty() and not as_json and not prometheus
    previous = None
    with _until_interrupted(), contextlib.suppress(KeyboardInterrupt):
        while True:
            try:
                snap = _sample(ctl, stale_after)
            except CtlError as exc:
                if clear:
                    click.clear()
                click.echo(f"wheelctl: {exc.message} (retrying every {watch:g} s, Ctrl-C to stop)")
                previous = None
            else:
                rate = SN.rates(previous, snap) if previous is not None else None
                if clear:
                    click.clear()
                _emit(snap, rate, as_json, prometheus, compact=True)
                if not as_json and not prometheus and not clear:
                    click.echo("")
                previous = snap
            time.sleep(watch)


# ---------------------------------------------------------------------------- add / cancel
@main.command(cls=_SignedArguments)
@click.argument("key")
@click.argument("delay_ms", type=int)
@_group_option
@_key_type_option
@click.pass_obj
def add(ctl: Ctl, key: str, delay_ms: int, group: str, key_type: str) -> None:
    """Schedule KEY to expire DELAY_MS from now (an armed key is re-armed).

    Connects as a member of the group for a moment, adds, and waits until the
    daemon applied it. The deadline printed is the one add() returned, which
    the expiration carries and ``dump`` shows.
    """
    user_key = _parse_key(key, key_type)
    if delay_ms < 0:  # the library's own check, before anything is sent or opened
        from wheeld.core import check_delay_ms

        try:
            check_delay_ms(delay_ms)
        except InvalidDelay as exc:
            raise CtlError(f"InvalidDelay: {exc}", EXIT_USAGE) from None
    reader = ctl.optional_reader()
    try:
        before = reader.lookup(user_key, group) if reader is not None else None
        client = ctl.connect(group)
        try:
            with _daemon_errors(ctl):
                deadline = client.add(user_key, delay_ms)
                client.flush(timeout_s=ctl.timeout_s)
        finally:
            _leave(client)
    finally:
        if reader is not None:
            reader.close()
    verb = "re-armed" if before is not None else "added"
    was = f" (was due in {_fmt_ms(before.deadline_ms - (deadline - delay_ms))})" if before is not None else ""
    click.echo(f"{verb} {_show_key(user_key)} in group {group!r}: due in {_fmt_ms(delay_ms)}, "
               f"deadline {deadline} (CLOCK_MONOTONIC ms){was}")


@main.command(cls=_SignedArguments)
@click.argument("key")
@_group_option
@_key_type_option
@click.pass_obj
def cancel(ctl: Ctl, key: str, group: str, key_type: str) -> None:
    """Cancel KEY's pending timer. Exit 0 if one was removed, 1 if none was pending.

    The arena is looked at before the cancel and after the daemon applied it:
    0 means a pending timer of KEY existed and the daemon removed it; 1 means
    there was none, or it expired before the cancel reached the daemon.
    """
    user_key = _parse_key(key, key_type)
    reader = ctl.optional_reader()
    try:
        before = reader.lookup(user_key, group) if reader is not None else None
        counters_before = reader.counters() if reader is not None else None
        client = ctl.connect(group)
        try:
            with _daemon_errors(ctl):
                client.cancel(user_key)
                client.flush(timeout_s=ctl.timeout_s)
        finally:
            _leave(client)
        applied_ms = SN.mono_ms()
        shown = f"{_show_key(user_key)} in group {group!r}"
        if reader is None:
            click.echo(f"cancel of {shown} applied; the arena is not readable here, so whether a timer was "
                       f"pending is unknown")
            return
        if before is None:
            raise CtlError(f"no pending timer {shown}", EXIT_FAILED)
        state, generation = reader.record_state(before.slot)
        if generation == before.generation and state == "fired":
            raise CtlError(f"{shown} had already expired (deadline {before.deadline_ms}); nothing cancelled",
                           EXIT_FAILED)
        if generation == before.generation and state == "scheduled":
            raise CtlError(f"{shown} is still pending after the cancel (re-armed concurrently?)", EXIT_FAILED)
        could_have_fired = before.deadline_ms <= applied_ms
        assert counters_before is not None  # read with the arena, which is readable here
        if could_have_fired and reader.counters()["cancels_total"] == counters_before["cancels_total"]:
            raise CtlError(f"{shown} expired before the cancel reached the daemon; nothing cancelled", EXIT_FAILED)
        click.echo(f"cancelled {shown} (was due in {_fmt_ms(max(0, before.deadline_ms - applied_ms))})")
    finally:
        if reader is not None:
            reader.close()


# ---------------------------------------------------------------------------- tail
@main.command()
@click.option("--group", "-g", default="default", show_default=True, metavar="G", help="The group to join.")
@click.option("--count", "-n", type=click.IntRange(min=1), default=None, help="Exit after N expirations.")
@click.option("--duration", type=click.FloatRange(min=0), default=None, metavar="SECONDS",
              help="Exit after SECONDS.")
@click.pass_obj
def tail(ctl: Ctl, group: str, count: int | None, duration: float | None) -> None:
    """Print the group's expirations as JSON lines while they happen.

    WARNING: tail joins the group as a member and RECEIVES its expirations: the
    daemon gives each expiration to one member, so those printed here do not
    reach your workers. Use it on a group no worker consumes (or to drain one).
    Ctrl-C exits 0.

    Each line: key, key_type, group, deadline_ms, fired_ms, late_ms, late
    (fired after a daemon restart), received_ms (all CLOCK_MONOTONIC ms).
    """
    client = ctl.connect(group)
    click.echo(f"wheelctl: tailing group {group!r} (this session takes its expirations)", err=True)
    seen = 0
    end = None if duration is None else time.monotonic() + duration
    try:
        with _daemon_errors(ctl), _until_interrupted():
            while (count is None or seen < count) and (end is None or time.monotonic() < end):
                wait = 0.5 if end is None else max(0.0, min(0.5, end - time.monotonic()))
                batch = client.poll(wait)
                received = SN.mono_ms()
                for expired in batch:
                    click.echo(json.dumps({
                        "key": R.key_json(expired.key), "key_type": R.key_type_name(expired.key), "group": group,
                        "deadline_ms": expired.deadline_ms, "fired_ms": expired.fired_ms,
                        "late_ms": expired.fired_ms - expired.deadline_ms, "late": expired.late,
                        "received_ms": received,
                    }, separators=(",", ":")))
                    seen += 1
                sys.stdout.flush()
    except KeyboardInterrupt:
        pass
    finally:
        client.close()  # acknowledges what was printed


# ---------------------------------------------------------------------------- dump / groups / check
@main.command()
@click.option("--limit", "-n", type=click.IntRange(1, 1_000_000), default=50, show_default=True,
              help="Show at most N timers (the earliest deadlines first).")
@click.option("--group", "-g", default=None, metavar="G", help="Only this group's timers.")
@click.option("--fired", is_flag=True, help="Also fired timers not acknowledged yet.")
@click.option("--json", "as_json", is_flag=True, help="One JSON document.")
@click.pass_obj
def dump(ctl: Ctl, limit: int, group: str | None, fired: bool, as_json: bool) -> None:
    """Pending timers from the arena: key, group, deadline, due in."""
    with ctl.reader() as reader:
        if group is not None and reader.group_id(group) is None:
            raise CtlError(f"no group {group!r} in {reader.segment_name}", EXIT_FAILED)
        total, timers = reader.timers(limit, group, fired)
        now = SN.mono_ms()
    if as_json:
        click.echo(json.dumps({"now_ms": now, "total": total, "shown": len(timers),
                               "timers": [t.to_dict(now) for t in timers]}, indent=2))
        return
    rows = [(_show_key(t.key), t.group, str(t.deadline_ms), _fmt_due(t.deadline_ms - now), t.state) for t in timers]
    header = ("KEY", "GROUP", "DEADLINE_MS", "DUE IN", "STATE")
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]
    for row in [header, *rows]:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    what = "pending or fired" if fired else "pending"
    click.echo(f"{len(timers)} of {_fmt_int(total)} {what} timers shown (earliest deadline first)")


def _fmt_due(ms: int) -> str:
    return f"{_fmt_ms(ms)}" if ms >= 0 else f"overdue {_fmt_ms(-ms)}"


@main.command()
@click.option("--json", "as_json", is_flag=True, help="One JSON document.")
@click.pass_obj
def groups(ctl: Ctl, as_json: bool) -> None:
    """Group ids in use: name, live records (pending + fired), live client slots.

    An id is in use while a name is registered under it or a live record carries
    it; the daemon reclaims groups with no member and nothing pending. Live
    records are counted from the arena's records (one pass over their state and
    group columns).
    """
    with ctl.reader() as reader:
        snap = reader.snapshot()
    if as_json:
        click.echo(json.dumps({"active": snap.counters["groups_active"], "in_use": snap.groups_in_use,
                               "max": snap.max_groups, "groups": [g.to_dict() for g in snap.groups]}, indent=2))
        return
    click.echo(_groups_in_use(snap))
    click.echo(_groups_table(snap.groups))


@main.command()
@click.option("--json", "as_json", is_flag=True, help="One JSON document.")
@click.option("--attempts", type=click.IntRange(1, 100), default=5, show_default=True,
              help="Copies taken at most while a live daemon keeps writing.")
@click.option("--journal", "journal_dir", default=None, metavar="DIR",
              type=click.Path(exists=True, file_okay=False, dir_okay=True),
              help="Check this journal directory instead of the arena: list every damaged range (file, byte "
                   "offsets, lines, what recovery loses or keeps); exit 1 if there is any.")
@click.pass_obj
def check(ctl: Ctl, as_json: bool, attempts: int, journal_dir: str | None) -> None:
    """Verify the arena's invariants on a private copy; exit 1 when broken.

    The live arena is never written: the segment is copied into private memory,
    checked there (links, lists, buckets, free list, duplicate keys, counters),
    and the wheel's own recovery is run on the copy to show what a daemon
    restart would repair.

    With --journal DIR the journal directory is checked instead (no daemon
    needed, nothing written): every segment and snapshot is read, and every
    damaged range listed with what a recovery would lose (the events of its
    lines) and keep (everything else). Exit 1 when there is damage; a torn
    tail alone (a write cut short by a crash, which recovery cuts) is not.
    """
    if journal_dir is not None:
        _check_journal(journal_dir, as_json)
        return
    try:
        report = CK.check(ctl.name, attempts=attempts)
    except R.NoArena as exc:
        raise CtlError(str(exc), EXIT_NO_DAEMON) from None
    except CorruptArena as exc:
        report = CK.CheckReport([str(exc)], 1, True, [], [])
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    else:
        segment = reader_segments(ctl.name)[0]
        if report.ok:
            copies = f"{report.copies} cop{'y' if report.copies == 1 else 'ies'}"
            click.echo(f"ok: {segment}: every invariant holds ({copies}"
                       f"{'' if report.quiet else ', taken while the daemon was writing'})")
        elif report.inconclusive:
            click.echo(f"inconclusive: {segment} changed during each of {report.copies} copies and no problem "
                       f"showed twice; try again when the daemon is less busy")
        else:
            click.echo(f"BROKEN: {segment}:")
            for problem in report.problems:
                click.echo(f"  {problem}")
            for problem in report.after_recovery:
                click.echo(f"  after recovery: {problem}")
            if report.daemon_alive and not report.quiet:
                click.echo("  (the daemon was not parked: a loop stopped mid-update also looks like this; "
                           "recovery below is what a restart would do)")
        if report.repairs:
            click.echo("a daemon restart would repair:")
            for repair in report.repairs:
                click.echo(f"  {repair}")
    if not report.ok:
        sys.exit(EXIT_FAILED)


@main.command()
@click.option("--name", "instance", default=None, metavar="NAME",
              help="The instance whose segments go (default: wheelctl's --name / $WHEELD_NAME).")
@click.pass_obj
def destroy(ctl: Ctl, instance: str | None) -> None:
    """Remove a stopped daemon's shared memory: lock, arena, client table, secret (plain and
    uid-qualified names), set-aside copies.

    Refused (exit 1, nothing removed) while a daemon holds the instance's lock.
    Every pending timer in the arena goes with it; a journal (--journal DIR) is
    not touched, so a daemon started with it later rebuilds them from there."""
    from wheeld.shm.instance_lock import holder
    from wheeld.shm.arena import remove_instance_segments

    name = instance or ctl.name
    try:
        running = holder(name)
    except PermissionError:
        raise CtlError(f"may not read the lock of wheeld instance {name!r}: run as the daemon's user or root",
                       EXIT_NO_DAEMON) from None
    if running is not None:
        raise CtlError(f"{running.describe(name)} (it holds its lock); stop it first", EXIT_FAILED)
    try:
        removed = remove_instance_segments(name)
    except PermissionError as exc:
        raise CtlError(f"may not remove {exc.filename}: {exc.strerror} (run as the daemon's user or root)",
                       EXIT_NO_DAEMON) from None
    if removed:
        click.echo(f"removed {len(removed)} segment(s) of wheeld instance {name!r}: {', '.join(removed)}")
    else:
        click.echo(f"nothing to remove: no segment of wheeld instance {name!r} in {SHM_DIR}")


def _check_journal(directory: str, as_json: bool) -> None:
    from wheeld.journal.recovery import check_journal

    try:
        report = check_journal(directory)
    except OSError as exc:
        raise CtlError(f"cannot read the journal in {directory}: {exc}", EXIT_NO_DAEMON) from None
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    else:
        counts = report.to_dict()
        files = (f"{report.segments} segment{'s' if report.segments != 1 else ''}, "
                 f"{report.snapshots} snapshot{'s' if report.snapshots != 1 else ''}")
        recovery = (f"a recovery would rebuild {_fmt_int(report.pending)} pending and {_fmt_int(report.unacked)} "
                    f"unacknowledged timers (snapshot lsn {report.snapshot_lsn}, last lsn {report.last_lsn})")
        if report.ok:
            click.echo(f"ok: journal {directory}: {files}, no damaged line; {recovery}")
        else:
            click.echo(f"DAMAGED: journal {directory}: {files}; {counts['damaged_ranges']} damaged "
                       f"range{'s' if counts['damaged_ranges'] != 1 else ''}, {counts['damaged_lines']} "
                       f"line{'s' if counts['damaged_lines'] != 1 else ''}, {counts['lost_events']} "
                       f"event{'s' if counts['lost_events'] != 1 else ''} lost")
            for item in report.damage:
                click.echo(f"  {os.path.basename(item.path)} {item.where()}: {item.reason}: {item.detail}")
                click.echo(f"      {item.cost()} -> {item.action}")
            click.echo(f"{recovery}; everything else is kept")
        for torn in report.torn:
            click.echo(f"torn tail (a write cut short by a crash; recovery cuts it): {os.path.basename(torn.path)} "
                       f"{torn.detail}")
    if not report.ok:
        sys.exit(EXIT_FAILED)


from .ctl_report import report  # noqa: E402  (imports pyspark only when it runs)

main.add_command(report)  # wheelctl report JOURNAL_DIR --out DIR [--master URL]

from .ctl_fleet import fleet  # noqa: E402  (imports nats-py only when it runs)

main.add_command(fleet)  # wheelctl fleet [forget HOST] --replicate URLS


if __name__ == "__main__":
    main()
