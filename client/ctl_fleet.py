"""``wheelctl fleet``: the hosts of a fleet (wheeld --replicate), their leases and streams.

``wheelctl fleet --replicate URLS`` (or ``$WHEELD_NATS_URLS``) lists every host with a
stream in the cluster: who holds its lease (the host itself, a peer that adopted it, or
nobody: lapsed), the lease's epoch and age, the stream's messages, bytes and last lsn,
and whether a fence ends it (adopted, by whom). ``wheelctl fleet forget HOST`` deletes a
host's stream and lease, so a host that was adopted can join again, empty. Credentials:
``WHEELD_NATS_USER``/``WHEELD_NATS_PASSWORD`` or ``WHEELD_NATS_CREDS``, as the daemon's.
nats-py (``wheeld[fleet]``) is imported only when a command runs.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import click

from wheeld.fleet import stream as S

_URLS = click.option("--replicate", "urls", envvar="WHEELD_NATS_URLS", required=True, metavar="URL,URL,...",
                     help="The NATS cluster the hosts replicate to [env WHEELD_NATS_URLS].")


async def _connect(urls: str):
    try:
        import nats
    except ImportError:
        raise click.ClickException("wheelctl fleet needs nats-py: pip install 'wheeld[fleet]'") from None
    env = os.environ
    options: dict = dict(servers=[u.strip() for u in urls.split(",") if u.strip()], connect_timeout=3,
                         allow_reconnect=False, max_reconnect_attempts=0)
    if env.get("WHEELD_NATS_CREDS"):
        options["user_credentials"] = env["WHEELD_NATS_CREDS"]
    elif env.get("WHEELD_NATS_USER"):
        options["user"], options["password"] = env["WHEELD_NATS_USER"], env.get("WHEELD_NATS_PASSWORD", "")
    try:
        return await nats.connect(**options)
    except Exception as exc:
        raise click.ClickException(f"cannot reach the cluster at {urls}: {exc or type(exc).__name__}") from None


async def fleet_rows(urls: str) -> list[dict]:
    """One row per host with a stream (see the module docstring)."""
    from nats.js.errors import NotFoundError

    nc = await _connect(urls)
    try:
        js = nc.jetstream(timeout=3)
        leases: dict[str, tuple] = {}
        try:
            kv = await js.key_value(S.LEASE_BUCKET)
            for host in await kv.keys():
                entry = await kv.get(host)
                leases[host] = (S.msgspec_decode_lease(entry.value), entry)
        except Exception:  # no bucket, or no keys
            pass
        rows = []
        for info in await js.streams_info():
            name = info.config.name
            if not name.startswith("WHEELD_"):
                continue
            host = name[len("WHEELD_"):]
            row = {"host": host, "messages": info.state.messages, "bytes": info.state.bytes,
                   "lease_holder": None, "epoch": None, "lease_age_s": None, "last_lsn": None,
                   "last_kind": None, "adopted_by": None}
            lease = leases.get(host)
            if lease is not None:
                row["lease_holder"], row["epoch"] = lease[0].holder, lease[0].epoch
                row["lease_age_s"] = round(max(0.0, time.time() - lease[0].t / 1000), 1) if lease[0].t else None
            try:
                last = await js.get_msg(name, subject=S.subject(host), direct=False)
                h = last.headers or {}
                row["last_kind"] = h.get(S.H_KIND)
                if row["last_kind"] == S.FENCE:
                    row["adopted_by"] = h.get(S.H_HOST)
                else:
                    row["last_lsn"] = int(h.get(S.H_LSN, "0 0").split()[1])
            except NotFoundError:
                pass
            rows.append(row)
        return sorted(rows, key=lambda r: r["host"])
    finally:
        await nc.close()


async def forget_host(urls: str, host: str) -> list[str]:
    """Delete a host's stream and lease; returns what was deleted."""
    nc = await _connect(urls)
    try:
        return await forget_on(nc, host)
    finally:
        await nc.close()


async def forget_on(nc, host: str) -> list[str]:
    """:func:`forget_host` on a connection of the caller's (``nats.connect``)."""
    deleted = []
    js = nc.jetstream(timeout=3)
    try:
        await js.delete_stream(S.stream_name(host))
        deleted.append(f"stream {S.stream_name(host)}")
    except Exception:
        pass
    try:
        kv = await js.key_value(S.LEASE_BUCKET)
        await kv.purge(host)
        deleted.append(f"lease {host}")
    except Exception:
        pass
    return deleted


@click.group(invoke_without_command=True)
@_URLS
@click.option("--json", "as_json", is_flag=True, help="One JSON document.")
@click.pass_context
def fleet(ctx: click.Context, urls: str, as_json: bool) -> None:
    """Hosts of the fleet: lease holders, epochs, streams (docs/fleet.md)."""
    ctx.ensure_object(dict)["urls"] = urls
    if ctx.invoked_subcommand is not None:
        return
    rows = asyncio.run(fleet_rows(urls))
    if as_json:
        click.echo(json.dumps({"hosts": rows}, indent=2))
        return
    if not rows:
        click.echo("no host replicates to this cluster")
        return
    click.echo(f"{'host':<24} {'lease holder':<24} {'epoch':>5} {'renewed':>8} {'messages':>9} {'bytes':>12} "
               f"{'last lsn':>10}  state")
    for r in rows:
        holder = r["lease_holder"] or "-"
        if r["adopted_by"]:
            state = f"ADOPTED by {r['adopted_by']}"
        elif r["lease_holder"] is None:
            state = "LEASE LAPSED (a peer with --adopt takes it over)"
        elif r["lease_holder"] != r["host"]:
            state = f"being adopted by {r['lease_holder']}"
        else:
            state = "live"
        renewed = f"{r['lease_age_s']}s" if r["lease_age_s"] is not None else "-"
        click.echo(f"{r['host']:<24} {holder:<24} {r['epoch'] if r['epoch'] is not None else '-':>5} {renewed:>8} "
                   f"{r['messages']:>9} {r['bytes']:>12} {r['last_lsn'] if r['last_lsn'] is not None else '-':>10}  "
                   f"{state}")


@fleet.command()
@click.argument("host")
@click.option("--yes", is_flag=True, help="Do not ask.")
@click.pass_obj
def forget(obj: dict, host: str, yes: bool) -> None:
    """Delete HOST's stream and lease (HOST must not run): a host that was adopted can
    then join the fleet again, with an empty journal."""
    try:
        S.check_host_id(host)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    if not yes and sys.stdin.isatty():
        click.confirm(f"delete the stream and lease of host {host}?", abort=True)
    deleted = asyncio.run(forget_host(obj["urls"], host))
    click.echo(f"{host}: deleted {', '.join(deleted)}" if deleted else f"{host}: nothing to delete")
