"""Benchmark of the fleet pipeline: the Spark job vs the same work in one pandas process.

    python -m bench.pipeline --sizes 100k,1M,10M   # the full run (~15-25 min, ~3 GB of journals in /tmp)
    python -m bench.pipeline --sizes 100k,1M       # what fits while others use the machine
    python -m bench.pipeline --crc                 # the crc check alone: SQL expression vs UDFs

Both sides do the whole job on the same generated fleet (``pipeline.generate``,
16 hosts, the daemon's own journal writer): find the segments, check every
line's crc, decode the events, write the ``events`` Parquet table, compute
every figure table and write them. Rendering the HTML report is left out on
both sides (it is the same matplotlib code either way).

* **spark** -- :func:`wheeld.pipeline.job.run` in ``local[*]`` (both cores),
  with a session started once and one untimed warm-up job (the first job in
  a JVM also pays JIT and code generation): ``spark_s`` is the job on a warm
  session, ``spark_cold_s`` adds the session start-up measured in the same
  run (about what ``wheelctl report`` pays; a fresh process also pays the
  warm-up, reported as ``spark_first_job_s``).
* **pandas** -- one Python process: ``zlib.crc32`` per line (pandas has no
  crc), the verified bodies parsed by pyarrow's JSON reader (the fastest
  single-process JSON-lines parser at hand, as ``pd.read_json(engine=
  "pyarrow")`` would use), the two aggregations with pandas ``groupby`` and
  numpy (exact nearest-rank percentiles by sorting), then the very same
  driver-side derivation (:func:`wheeld.pipeline.job.figure_tables`) the
  Spark job uses. pyarrow cannot give ``k`` one type when a fleet mixes int
  and str keys, and no figure uses it, so this side's ``events`` table has no
  ``key`` column. At the smallest size the bench checks that both sides'
  figure tables are equal, so the comparison is of the same aggregation.

The table gives events per second (events in the fleet / wall time) and the
crossover: the smallest measured size at which Spark (warm and cold) beats
pandas. ``bench/results/pipeline.json`` keeps the numbers with the machine's
load at the start: on the project's shared 2-core machines, read the figures
with that load in mind.
"""

from __future__ import annotations

import argparse
import io
import math
import os
import shutil
import sys
import time
import zlib
from pathlib import Path

if __package__ in (None, ""):  # python bench/pipeline.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import add_save_option, format_table, write_json  # noqa: E402

HOSTS = 16
DEFAULT_SIZES = "100k,1M,10M"
CRC_SEPARATOR = b',"crc":'


def parse_size(text: str) -> int:
    text = text.strip().lower()
    scale = {"k": 1_000, "m": 1_000_000}.get(text[-1], 1)
    return int(float(text[:-1] if text[-1] in "km" else text) * scale)


def fleet_for(size: int, data_dir: Path) -> Path:
    """A generated fleet of ``size`` events (cached between runs)."""
    from wheeld.pipeline.generate import generate_fleet

    root = data_dir / f"fleet-{size}-h{HOSTS}"
    marker = root / ".complete"
    if not marker.exists():
        shutil.rmtree(root, ignore_errors=True)
        started = time.perf_counter()
        generate_fleet(root, hosts=HOSTS, events_per_host=max(1, size // HOSTS), seed=1, slow_hosts=2, workers=1)
        marker.write_text(f"{time.perf_counter() - started:.1f} s\n")
    return root


# --------------------------------------------------------------------------- #
# The pandas side
# --------------------------------------------------------------------------- #


def _verified_bodies(path: str) -> tuple[bytes, int, int]:
    """(verified bodies joined by newlines, lines, bad lines) of one segment."""
    with open(path, "rb") as file:
        data = file.read()
    lines = data.split(b"\n")
    tail = lines.pop()
    crc32 = zlib.crc32
    good = []
    bad = 1 if tail else 0
    for line in lines:
        cut = line.rfind(CRC_SEPARATOR)
        digits = line[cut + 7 : -1]
        if cut >= 0 and line.endswith(b"}") and digits.isdigit() and len(digits) <= 10:
            body = line[:cut] + b"}"
            if crc32(body) == int(digits):
                good.append(body)
                continue
        bad += 1
    return b"\n".join(good), len(lines) + (1 if tail else 0), bad


def pandas_job(root: Path, out: Path) -> dict:
    """The whole job in one process with pandas/pyarrow; returns the figure tables."""
    import numpy as np
    import pandas as pd
    import pyarrow as pa
    import pyarrow.json as pajson
    import pyarrow.parquet as pq

    from wheeld.pipeline import job, reference

    schema = pa.schema(
        [("ev", pa.string()), ("v", pa.int64()), ("n", pa.int64()), ("t", pa.int64()), ("g", pa.string()),
         ("s", pa.int64()), ("d", pa.int64()), ("pd", pa.int64()), ("i", pa.int64()), ("f", pa.int64()),
         ("lat", pa.int64()), ("late", pa.bool_()), ("hit", pa.bool_()), ("host", pa.string()), ("name", pa.string())]
    )  # fmt: skip
    options = pajson.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
    tables = []
    segments = []
    for path in reference.segment_files(str(root)):
        bodies, lines, bad = _verified_bodies(path)
        table = pajson.read_json(io.BytesIO(bodies), parse_options=options) if bodies else schema.empty_table()
        ev = table.column("ev").to_numpy(zero_copy_only=False)
        header = table.slice(0, 1).to_pylist()[0] if len(table) and ev[0] == "segment" else None
        host = header["host"] if header else os.path.basename(os.path.dirname(path))
        events = table.filter(pa.compute.not_equal(table.column("ev"), "segment")).drop_columns(["host", "name"])
        tables.append(events.append_column("host", pa.array([host] * len(events), pa.string())))
        segments.append({
            "segment": path, "host": host, "daemon": header["name"] if header else None,
            "size_bytes": os.path.getsize(path), "lines": lines, "events": len(events),
            "headers": 1 if header else 0, "torn_tail": 0, "checksum_mismatch": bad, "unsupported_version": 0,
            "bad_json": 0, "bad_lines": bad, "status": "damaged" if bad else "ok",
        })  # fmt: skip
    events = pa.concat_tables(tables) if tables else schema.empty_table()
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(events, out / "events.parquet")

    frame = events.select(["ev", "t", "g", "host", "lat", "late", "hit", "i"]).to_pandas()
    frame.columns = ["event", "t_ms", "group", "host", "lateness_ms", "overdue", "hit", "idle_ms"]
    width = reference.bucket_width_ms(
        int(frame["t_ms"].min()) if len(frame) else None, int(frame["t_ms"].max()) if len(frame) else None
    )
    frame["bucket_ms"] = frame["t_ms"] - frame["t_ms"] % width
    frame["hour_ms"] = frame["t_ms"] - frame["t_ms"] % reference.HOUR_MS

    fires = frame[frame["event"] == "fire"].copy()
    fires["overdue"] = fires["overdue"].astype("boolean").fillna(False).astype(bool)
    lateness_parts = []
    for keys in job.LATENESS_SETS.values():
        keys = list(keys)
        running = fires[~fires["overdue"]]
        if keys:
            ordered = running.sort_values([*keys, "lateness_ms"])
            sizes = ordered.groupby(keys, sort=False).size()
            rows = sizes.index.to_frame(index=False)
        else:
            ordered = running.sort_values("lateness_ms")
            sizes = pd.Series([len(ordered)]) if len(ordered) else pd.Series([], dtype="int64")
            rows = pd.DataFrame(index=range(len(sizes)))
        counts = sizes.to_numpy()
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        values = ordered["lateness_ms"].to_numpy()
        rows["fires"] = counts
        for name, quantile in reference.QUANTILES.items():
            rank = np.maximum(1, np.ceil(counts * quantile)).astype(np.int64)
            rows[name] = values[starts + rank - 1] if len(counts) else []
        rows["max_ms"] = values[starts + counts - 1] if len(counts) else []
        overdue = fires[fires["overdue"]].groupby(keys).size() if keys else pd.Series([int(fires["overdue"].sum())])
        overdue = overdue[overdue > 0] if keys else overdue
        if keys:
            overdue_rows = overdue.rename("overdue_fires").reset_index()
            rows = rows.merge(overdue_rows, on=keys, how="outer")
            rows["fires"] = rows["fires"].fillna(0)
            rows["overdue_fires"] = rows["overdue_fires"].fillna(0)
        else:
            rows["overdue_fires"] = overdue.to_numpy()[: len(rows)]
        for key in job.LATENESS_KEYS:
            if key not in keys:
                rows[key] = None
        rows["gid"] = job._grouping_id(job.LATENESS_KEYS, tuple(keys))
        lateness_parts.append(rows)
    lateness_rows = pd.concat(lateness_parts, ignore_index=True)

    flags = pd.DataFrame({
        "events": 1,
        **{column: frame["event"] == kind for kind, column in reference._THROUGHPUT_COLUMNS},
        "cancelled_hit": (frame["event"] == "cancel") & (frame["hit"] == True),  # noqa: E712
        "cancelled_miss": (frame["event"] == "cancel") & (frame["hit"] == False),  # noqa: E712
        "idle_arms": frame["idle_ms"].notna() & frame["event"].isin(["add", "rearm"]),
        "idle_fires": frame["idle_ms"].notna() & (frame["event"] == "fire"),
    })  # fmt: skip
    flags[["bucket_ms", "group", "host", "t_ms"]] = frame[["bucket_ms", "group", "host", "t_ms"]]
    count_columns = [c for c in flags.columns if c not in ("bucket_ms", "group", "host", "t_ms")]
    count_parts = []
    for keys in job.COUNT_SETS.values():
        keys = list(keys)
        grouped = flags.groupby(keys) if keys else flags.groupby(lambda _: 0)
        rows = grouped[count_columns].sum()
        rows["hosts"] = grouped["host"].nunique()
        rows["groups"] = grouped["group"].nunique()
        rows["first_ms"] = grouped["t_ms"].min()
        rows["last_ms"] = grouped["t_ms"].max()
        rows = rows.reset_index(drop=not keys)
        for key in job.COUNT_KEYS:
            if key not in keys:
                rows[key] = None
        rows["gid"] = job._grouping_id(job.COUNT_KEYS, tuple(keys))
        count_parts.append(rows)
    count_rows = pd.concat(count_parts, ignore_index=True)

    tables, _summary = job.figure_tables(lateness_rows, count_rows, segments, bucket_width_ms=width)
    for name, table in tables.items():
        pq.write_table(pa.Table.from_pandas(table, preserve_index=False), out / f"{name}.parquet")
    return tables


def _same_figures(spark_tables: dict, pandas_tables: dict) -> list[str]:
    """Names of figure tables that differ (``segments`` aside: pandas has no per-reason split)."""
    differ = []
    for name, table in spark_tables.items():
        if name in ("segments", "summary"):
            continue
        left = table.astype(object).where(table.notna(), None).to_dict("records")
        other = pandas_tables[name]
        right = other.astype(object).where(other.notna(), None).to_dict("records")
        if left != right:
            differ.append(name)
    return differ


# --------------------------------------------------------------------------- #
# The crc check alone
# --------------------------------------------------------------------------- #


def crc_bench(spark, root: Path) -> list[dict]:
    import pandas as pd
    from pyspark.sql import functions as F

    from wheeld.pipeline.job import crc_ok_column
    from wheeld.protocol import journal

    text = (
        spark.read.option("lineSep", "\n").option("recursiveFileLookup", "true")
        .option("pathGlobFilter", "journal-*.jsonl").text(str(root))
    )  # fmt: skip
    lines = text.count()

    def check_batch(values):
        return values.map(journal.check_line)

    # real (not string) hints: pyspark infers the UDF kind from them
    check_batch.__annotations__ = {"values": pd.Series, "return": pd.Series}
    crc_arrow = F.pandas_udf(check_batch, "boolean")

    crc_python = F.udf(journal.check_line, "boolean")
    variants = [
        ("read only (no check)", text),
        ("Spark SQL expression", text.where(crc_ok_column(F.col("value")))),
        ("pandas_udf (Arrow)", text.where(crc_arrow("value"))),
        ("Python udf", text.where(crc_python("value"))),
    ]
    rows = []
    for name, frame in variants:
        best = math.inf
        for _ in range(2):
            started = time.perf_counter()
            kept = frame.count()
            best = min(best, time.perf_counter() - started)
        rows.append({"variant": name, "lines": lines, "kept": kept, "seconds": round(best, 3),
                     "lines_per_s": lines / best})  # fmt: skip
    return rows


# --------------------------------------------------------------------------- #


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help=f"fleet sizes in events (default {DEFAULT_SIZES})")
    parser.add_argument("--data-dir", default="/tmp/wheeld-bench-pipeline", help="where fleets are generated (cached)")
    parser.add_argument("--master", default="local[*]")
    parser.add_argument("--crc", action="store_true", help="only the crc-check comparison, on the first size")
    add_save_option(parser)
    args = parser.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    data_dir = Path(args.data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)

    from wheeld.pipeline import job
    from wheeld.pipeline.spark import session

    fleets = {}
    for size in sizes:
        started = time.perf_counter()
        fleets[size] = fleet_for(size, data_dir)
        print(f"fleet of {size:,} events ready in {time.perf_counter() - started:.1f} s: {fleets[size]}",
              file=sys.stderr)

    started = time.perf_counter()
    spark = session(args.master, progress=False)
    startup_s = time.perf_counter() - started
    print(f"spark {spark.version} on {spark.sparkContext.master}: session in {startup_s:.1f} s", file=sys.stderr)

    if args.crc:
        rows = crc_bench(spark, fleets[sizes[0]])
        print(format_table(rows, ["variant", "lines", "kept", "seconds", "lines_per_s"],
                           ["crc check", "lines", "kept", "s", "lines/s"]))  # fmt: skip
        print("wrote "
              f"{write_json('pipeline_crc', {'master': spark.sparkContext.master, 'rows': rows}, save=args.save)}")
        spark.stop()
        return 0

    # the first job in a JVM also pays JIT and code generation: do it once, untimed
    started = time.perf_counter()
    job.run(str(fleets[sizes[0]]), str(data_dir / "out-warmup"), spark=spark, render=False, progress=False)
    warmup_s = time.perf_counter() - started
    shutil.rmtree(data_dir / "out-warmup", ignore_errors=True)
    print(f"warm-up job on {sizes[0]:,} events: {warmup_s:.1f} s", file=sys.stderr)

    rows = []
    checked = None
    for size in sizes:
        root = fleets[size]
        out = data_dir / f"out-{size}"
        shutil.rmtree(out, ignore_errors=True)
        started = time.perf_counter()
        result = job.run(str(root), str(out / "spark"), spark=spark, render=False, progress=False)
        spark_s = time.perf_counter() - started
        events = result.summary["events"]
        started = time.perf_counter()
        pandas_tables = pandas_job(root, out / "pandas")
        pandas_s = time.perf_counter() - started
        if checked is None:
            checked = _same_figures(result.tables, pandas_tables)
        rows.append({
            "events": events,
            "bytes": sum(p.stat().st_size for p in root.rglob("journal-*.jsonl")),
            "spark_s": round(spark_s, 3),
            "spark_cold_s": round(spark_s + startup_s, 3),
            "pandas_s": round(pandas_s, 3),
            "spark_events_per_s": events / spark_s,
            "spark_cold_events_per_s": events / (spark_s + startup_s),
            "pandas_events_per_s": events / pandas_s,
            "spark_stages_s": result.stages_s,
        })  # fmt: skip
        print(f"{events:,} events: spark {spark_s:.1f} s, pandas {pandas_s:.1f} s", file=sys.stderr)
        shutil.rmtree(out, ignore_errors=True)
    spark.stop()

    def crossover(column: str) -> int | None:
        return next((row["events"] for row in rows if row[column] < row["pandas_s"]), None)

    warm, cold = crossover("spark_s"), crossover("spark_cold_s")
    not_reached = f"not reached up to {rows[-1]['events']:,} events"
    print(format_table(
        rows,
        ["events", "spark_s", "spark_cold_s", "pandas_s", "spark_events_per_s", "spark_cold_events_per_s",
         "pandas_events_per_s"],
        ["events", "spark s", "spark+start s", "pandas s", "spark ev/s", "spark+start ev/s", "pandas ev/s"],
    ))  # fmt: skip
    print(f"spark session start-up: {startup_s:.1f} s ({args.master}, {os.cpu_count()} cpus); "
          f"first (JIT-cold) job on {sizes[0]:,} events: {warmup_s:.1f} s")
    print(f"figures equal on both sides at {rows[0]['events']:,} events: {'yes' if not checked else checked}")
    print(f"crossover (Spark faster than pandas), warm session: {f'{warm:,} events' if warm else not_reached}")
    print(f"crossover including Spark start-up: {f'{cold:,} events' if cold else not_reached}")
    path = write_json("pipeline", {
        "master": args.master, "hosts": HOSTS, "spark_startup_s": round(startup_s, 3),
        "spark_first_job_s": round(warmup_s, 3), "rows": rows,
        "figures_equal_at_smallest_size": not checked, "crossover_warm_events": warm,
        "crossover_cold_events": cold,
    }, save=args.save)  # fmt: skip
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
