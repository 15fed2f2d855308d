"""The daemon's Prometheus endpoint: ``GET /metrics`` from its own event loop.

``wheeld --metrics ADDR:PORT`` serves, from the daemon's own event loop
(``asyncio.start_server``), the text :func:`wheeld.shm.prometheus.render` makes of a
snapshot of the daemon's own mapping of its arena: the same text ``wheelctl stats
--prometheus`` prints from the arena (the metric names are listed there).

The HTTP endpoint: ``GET`` (or ``HEAD``) ``/metrics`` answers 200 with
``text/plain; version=0.0.4``; any other path 404, any other method 405; a
request head over :data:`MAX_REQUEST_BYTES` or not complete within
:data:`REQUEST_TIMEOUT_S` is answered 400/408 and closed; at most
:data:`MAX_CONNECTIONS` connections at once (more are closed at once). One
response per connection (``Connection: close``). Rendering reads the wheel's
header from memory: a scrape never blocks the wheel loop for longer than that.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging

from wheeld.protocol.errors import InvalidRequest, WheeldError
from wheeld.shm.prometheus import CONTENT_TYPE, render
from wheeld.shm.snapshot import RingStat, Snapshot, build_snapshot

log = logging.getLogger("wheeld.metrics")

MAX_REQUEST_BYTES = 8192
REQUEST_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 16


def parse_address(addr: str) -> tuple[str | None, int]:
    """``ADDR:PORT`` -> (host, port). ``[v6]:PORT`` for IPv6; an empty ADDR (``:9464``) is every interface."""
    host, sep, port_text = addr.rpartition(":")
    if not sep or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise InvalidRequest(f"--metrics wants ADDR:PORT (e.g. 127.0.0.1:9464), not {addr!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise InvalidRequest(f"--metrics: {host!r} is not an IPv6 address") from None
    elif ":" in host:
        raise InvalidRequest(f"--metrics: write an IPv6 address in brackets, e.g. [::1]:9464, not {addr!r}")
    return (host or None), int(port_text)


def snapshot_from_daemon(daemon) -> Snapshot:
    """A snapshot from the running daemon's own mapping of its arena (no copy of the records)."""
    wheel = daemon.wheel
    rings = []
    for cs in list(daemon.clients.values()):
        depth = capacity = None
        if cs.segment is not None:  # None: waiting for its client to hand the ring back
            capacity = cs.segment.ring_capacity
            try:
                depth = cs.segment.depth()
            except WheeldError:  # a client that scribbled on its counters: depth unknown
                pass
        rings.append(RingStat(cs.slot, cs.group_name, cs.pid, depth, capacity, cs.session is not None))
    header = wheel.header_words().tobytes()
    return build_snapshot(daemon.config.name, wheel.name or "", header, wheel.groups(), rings, alive=True)


def _response(status: str, body: bytes, content_type: str = "text/plain; charset=utf-8",
              extra: str = "", head_only: bool = False) -> bytes:
    head = (f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\n{extra}\r\n").encode("latin-1")
    return head if head_only else head + body


async def start_metrics_server(daemon, addr: str) -> asyncio.AbstractServer:
    """Serve ``GET /metrics`` on ``addr`` (``ADDR:PORT``) from the running loop; returns the server.

    Raises InvalidRequest for a malformed address or one that cannot be bound.
    """
    host, port = parse_address(addr)
    active = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal active
        active += 1
        try:
            if active > MAX_CONNECTIONS:
                return
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT_S)
            except asyncio.TimeoutError:
                writer.write(_response("408 Request Timeout", b"request timeout\n"))
                return
            except (asyncio.LimitOverrunError, ValueError):
                writer.write(_response("400 Bad Request", b"request head too large\n"))
                return
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            request_line = head.split(b"\r\n", 1)[0].decode("latin-1", "replace")
            parts = request_line.split()
            if len(parts) != 3 or not parts[2].startswith("HTTP/"):
                writer.write(_response("400 Bad Request", b"bad request line\n"))
                return
            method, target = parts[0], parts[1]
            path = target.split("?", 1)[0]
            if method not in ("GET", "HEAD"):
                writer.write(_response("405 Method Not Allowed", b"GET only\n", extra="Allow: GET, HEAD\r\n"))
            elif path != "/metrics":
                writer.write(_response("404 Not Found", b"not found: try /metrics\n", head_only=method == "HEAD"))
            else:
                body = render(snapshot_from_daemon(daemon)).encode("utf-8")
                writer.write(_response("200 OK", body, CONTENT_TYPE, head_only=method == "HEAD"))
            await asyncio.wait_for(writer.drain(), REQUEST_TIMEOUT_S)
        except (ConnectionError, asyncio.TimeoutError):
            pass
        except Exception:  # noqa: BLE001 - a scrape must never take the daemon down
            log.exception("metrics request failed")
        finally:
            active -= 1
            writer.close()

    try:
        server = await asyncio.start_server(handle, host, port, limit=MAX_REQUEST_BYTES, reuse_address=True)
    except OSError as exc:
        raise InvalidRequest(f"cannot serve metrics on {addr}: {exc}") from exc
    bound = ", ".join(_sockname(s.getsockname()) for s in server.sockets)
    log.info("metrics on http://%s/metrics", bound)
    return server


def _sockname(name) -> str:
    host, port = name[0], name[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
