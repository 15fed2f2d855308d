"""``make fleet-demo``: a host lost, its timers delivered by a peer.

Starts a 3-node NATS JetStream cluster on loopback ports, and two wheeld "hosts" on this
machine (each its own instance name, journal directory and ``--host-id``), both
replicating with ``--durability replicated``; host B adopts A (``--adopt A``). A worker
on A arms timers (a flush() acknowledges them: stored on a quorum of the cluster), then
host A is lost: its daemon SIGKILLed, its shared memory and journal deleted. A worker on
B, in the same group, prints A's timers as they arrive, and a summary: how long the
takeover took, how many arrived, none early. Everything it started is stopped at the
end, by pid, and every file and segment removed.

    python examples/fleet_demo.py [--timers 2000] [--lease-ttl-s 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

import wheeld
from wheeld.fleet.cluster import NatsCluster
from wheeld.protocol.clock import mono_ms
from wheeld.testing import DaemonProcess, unique_name, unlink_segments


def host(workdir: str, cluster: NatsCluster, host_id: str, ttl_s: float, *extra: str) -> DaemonProcess:
    return DaemonProcess(workdir, capacity=100_000, name=f"demo-{host_id}-{unique_name()[-6:]}", extra=[
        "--journal", os.path.join(workdir, f"journal-{host_id}"), "--replicate", ",".join(cluster.urls),
        "--host-id", host_id, "--durability", "replicated", "--lease-ttl-s", str(ttl_s), *extra])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timers", type=int, default=2000)
    parser.add_argument("--lease-ttl-s", type=float, default=3.0)
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="wheeld-fleet-demo-")
    suffix = unique_name()[-6:]
    a_id, b_id = f"hostA-{suffix}", f"hostB-{suffix}"
    started: list[DaemonProcess] = []
    try:
        with NatsCluster(3, base_dir=os.path.join(workdir, "nats")) as cluster:
            print(f"NATS JetStream cluster of 3 on {', '.join(cluster.urls)}")
            a = host(workdir, cluster, a_id, args.lease_ttl_s)
            b = host(workdir, cluster, b_id, args.lease_ttl_s, "--adopt", a_id)
            for d in (a, b):
                started.append(d.start())
                d.wait_for_log("holds its lease", timeout=30)
            print(f"host {a_id}: wheeld pid {a.pid};  host {b_id}: wheeld pid {b.pid} (--adopt {a_id})")
            due = {}
            with wheeld.connect(a.socket_path, group="payments") as worker:
                t = time.perf_counter()
                for i in range(args.timers):
                    delay = 3_000 + (i * 7919) % 5_000
                    due[f"retry-{i}"] = mono_ms() + delay
                    worker.add(f"retry-{i}", delay)
                worker.flush()
                print(f"worker on {a_id}: {args.timers} timers due in 3-8 s, flush() returned in "
                      f"{(time.perf_counter() - t) * 1000:.1f} ms (stored on a quorum)")
            with wheeld.connect(b.socket_path, group="payments") as worker_b:
                lost_at = mono_ms()
                a.cleanup()  # SIGKILL, and its shared memory unlinked
                shutil.rmtree(os.path.join(workdir, f"journal-{a_id}"))
                print(f"host {a_id} LOST (daemon SIGKILLed, /dev/shm segments and journal deleted)")
                got, early, first = {}, 0, None
                end = time.monotonic() + args.lease_ttl_s + 15
                while len(got) < len(due) and time.monotonic() < end:
                    for e in worker_b.poll(0.2):
                        now = mono_ms()
                        first = first if first is not None else now
                        early += now < due.get(e.key, 0)
                        got[e.key] = got.get(e.key, 0) + 1
                        if len(got) % 500 == 1 or len(got) == len(due):
                            print(f"  {b_id} delivered {e.key} (late={e.late}) {now - lost_at} ms after the loss; "
                                  f"{len(got)}/{len(due)}")
            line = next((ln for ln in b.log().splitlines() if "ADOPTED" in ln), "(no takeover logged)")
            print(line.split(" WARNING ", 1)[-1])
            print(f"summary: {len(got)}/{len(due)} timers of {a_id} delivered on {b_id}, {early} early, "
                  f"{sum(got.values()) - len(got)} twice; first {first - lost_at if first else '-'} ms after "
                  f"the loss (lease TTL {args.lease_ttl_s} s)")
            print(subprocess.run([sys.executable, "-m", "wheeld.ctl", "fleet", "--replicate", ",".join(cluster.urls)],
                                 capture_output=True, text=True, timeout=30).stdout)
            ok = len(got) == len(due) and not early
    finally:
        for d in started:
            d.cleanup()
            unlink_segments(d.name)
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
