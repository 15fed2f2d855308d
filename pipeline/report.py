"""The fleet report: one self-contained HTML file with PNG charts.

The job (:mod:`wheeld.pipeline.job`) hands this module the small figure
tables as pandas DataFrames (collected from the Parquet it wrote); nothing
here needs Spark, so a report can be re-drawn from a finished run with
``python -m wheeld.pipeline.report OUT_DIR`` (it reads ``OUT/tables`` with
pyarrow).

What a reader sees, top to bottom
=================================

1. **Headline cards**: events, hosts, time span, fleet p99 and max lateness,
   timeout rate, and bad input (lines skipped, damaged and unreadable
   segments) in red when there is any; with replication samples, the
   replicating hosts, their highest lag, the time they spent behind the
   stream and the hosts fenced (red when any).
2. **Load over time**: adds, cancels and fires per second, averaged per time
   bucket: the diurnal shape, bursts, and whether fires follow adds.
3. **How late timers fire, over time**: fleet p50/p99/p99.9/max lateness per
   time bucket on a log scale; a slow host or a stall shows as a p99 spike.

The time charts use one bucket width, chosen by the job from the input's time
span (``summary.bucket_width_ms``, see :func:`wheeld.pipeline.reference.bucket_width_ms`:
120-300 points for any run of 100 s or more, never under 1 s); the axis
labels name it.
4. **Slowest hosts**: p99 bars with p50 and max marks, worst first.
5. **Lateness heat map**: p99 per host (rows, worst first) and hour
   (columns): which hosts fall behind, and when.
6. **Timeout rate by group**: fired / (fired + cancelled before deadline),
   Kafka purgatory's expiration rate; a request purgatory near 100% means
   operations almost never complete in time.
7. **Idle-timeout churn**: wake-ups that found the key touched (re-armed)
   versus real idle timeouts, per group.
8. **Noisiest groups**: events per group by type.
9. **Replication to the fleet's stream** (``wheeld --replicate``): the highest
   lag per host id and time bucket, log scale, the buckets with time behind,
   failed or fenced marked; the table lists those buckets, worst first.
10. **Input quality**: bad lines by reason and every damaged or unreadable
    segment, so nothing skipped goes unnoticed.

Charts are PNG (matplotlib, Agg backend, 110 dpi) embedded as base64
``data:`` URIs: the report is one file to mail or attach to a ticket.
"""

from __future__ import annotations

import base64
import datetime as dt
import html
import io
import json
import os
import sys
from typing import Any, Mapping

import pandas as pd

PALETTE = {
    "adds": "#4C72B0",
    "cancels": "#55A868",
    "fires": "#C44E52",
    "rearms": "#8172B2",
    "acks": "#CCB974",
    "idle_rearms": "#64B5CD",
    "p50_ms": "#4C72B0",
    "p99_ms": "#DD8452",
    "p999_ms": "#C44E52",
    "max_ms": "#6B6B6B",
    "behind": "#DD8452",
    "failed": "#8C564B",
    "fenced": "#C44E52",
}
HEATMAP_HOSTS = 30
REPLICATION_HOSTS = 12  # lines in the replication chart (the host ids with the highest lag)
DPI = 110


def _frame(table: Any) -> pd.DataFrame:
    if isinstance(table, pd.DataFrame):
        return table
    return pd.DataFrame(list(table or []))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _png(figure: Any) -> str:
    plt = _pyplot()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=DPI, bbox_inches="tight")
    plt.close(figure)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _times(ms: pd.Series) -> pd.Series:
    return pd.to_datetime(ms, unit="ms", utc=True)


def _fmt_ms(value: Any) -> str:
    if value is None or (isinstance(value, float) and pd.isna(value)):
        return "–"
    value = float(value)
    if value >= 60_000:
        return f"{value / 60_000:.1f} min"
    if value >= 1_000:
        return f"{value / 1_000:.2f} s"
    return f"{value:.0f} ms"


def _fmt_count(value: Any) -> str:
    if value is None or (isinstance(value, float) and pd.isna(value)):
        return "–"
    value = float(value)
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= size:
            return f"{value / size:.1f}{unit}"
    return f"{value:.0f}"


def _fmt_rate(value: Any) -> str:
    if value is None or (isinstance(value, float) and pd.isna(value)):
        return "–"
    return f"{100 * float(value):.1f}%"


def fmt_width(ms: int) -> str:
    """A bucket width for an axis label: ``1 s``, ``15 s``, ``2 min``, ``6 h``, ``1 day``."""
    ms = int(ms)
    if ms % 86_400_000 == 0:
        days = ms // 86_400_000
        return f"{days} day{'s' if days != 1 else ''}"
    if ms % 3_600_000 == 0:
        return f"{ms // 3_600_000} h"
    if ms % 60_000 == 0:
        return f"{ms // 60_000} min"
    if ms % 1_000 == 0:
        return f"{ms // 1_000} s"
    return f"{ms} ms"


def _fmt_time(ms: Any) -> str:
    if ms is None or (isinstance(ms, float) and pd.isna(ms)):
        return "–"
    shape = "%Y-%m-%d %H:%M UTC" if int(ms) % 60_000 == 0 else "%Y-%m-%d %H:%M:%S UTC"
    return dt.datetime.fromtimestamp(int(ms) / 1000, dt.timezone.utc).strftime(shape)


# --------------------------------------------------------------------------- #
# Charts: each returns base64 PNG or None when there is nothing to draw
# --------------------------------------------------------------------------- #


def chart_throughput(throughput: pd.DataFrame, bucket_width_ms: int) -> str | None:
    if throughput.empty:
        return None
    plt = _pyplot()
    width = fmt_width(bucket_width_ms)
    figure, axes = plt.subplots(layout="constrained", figsize=(10, 3.4))
    when = _times(throughput["bucket_ms"])
    for column in ("adds", "cancels", "fires"):
        axes.plot(when, throughput[f"{column}_per_s"], label=f"{column}/s", color=PALETTE[column], lw=1.4,
                  drawstyle="steps-post")
    axes.set_ylabel(f"events per second ({width} average)")
    axes.set_xlabel(f"time (UTC), {width} buckets")
    axes.set_ylim(bottom=0)
    axes.grid(alpha=0.3)
    figure.legend(loc="outside lower center", frameon=False, ncol=3, fontsize=8)
    axes.set_title(f"Load over time (average per {width} bucket)", loc="left", fontsize=11)
    figure.autofmt_xdate()
    return _png(figure)


def chart_lateness_over_time(over_time: pd.DataFrame, bucket_width_ms: int) -> str | None:
    """Fleet lateness percentiles per time bucket (the job chose the width from the span).

    Percentiles cannot be merged after the fact, so the job computes them for
    this one width; with few fires in a bucket, p99 = max.
    """
    frame = over_time[over_time["fires"] > 0] if not over_time.empty else over_time
    if frame.empty:
        return None
    plt = _pyplot()
    width = fmt_width(bucket_width_ms)
    figure, axes = plt.subplots(layout="constrained", figsize=(10, 3.4))
    when = _times(frame["bucket_ms"])
    for column, label in (("p50_ms", "p50"), ("p99_ms", "p99"), ("p999_ms", "p99.9")):
        axes.plot(when, frame[column].astype(float) + 1, label=label, color=PALETTE[column], lw=1.5,
                  drawstyle="steps-post")
    axes.scatter(when, frame["max_ms"].astype(float) + 1, label="max", color=PALETTE["max_ms"], s=8, zorder=3)
    axes.set_yscale("log")
    axes.set_ylabel("lateness + 1 (ms, log)")
    axes.set_xlabel(f"time (UTC), {width} buckets")
    axes.grid(alpha=0.3, which="both")
    figure.legend(loc="outside lower center", frameon=False, ncol=4, fontsize=8)
    axes.set_title(f"How late timers fire, per {width} bucket (fleet)", loc="left", fontsize=11)
    figure.autofmt_xdate()
    return _png(figure)


def chart_slowest_hosts(slowest: pd.DataFrame) -> str | None:
    if slowest.empty:
        return None
    plt = _pyplot()
    frame = slowest.sort_values("rank", ascending=False)
    figure, axes = plt.subplots(layout="constrained", figsize=(10, 0.32 * len(frame) + 1.2))
    positions = range(len(frame))
    axes.barh(positions, frame["p99_ms"].astype(float), color=PALETTE["p99_ms"], label="p99")
    axes.scatter(frame["p50_ms"].astype(float), positions, color=PALETTE["p50_ms"], zorder=3, s=18, label="p50")
    axes.scatter(frame["max_ms"].astype(float), positions, color=PALETTE["max_ms"], marker="|", s=120, zorder=3,
                 label="max")
    axes.set_yticks(list(positions), frame["host"])
    axes.set_xscale("symlog", linthresh=1)
    axes.set_xlabel("lateness (ms)")
    axes.grid(alpha=0.3, axis="x")
    figure.legend(loc="outside lower center", frameon=False, ncol=3, fontsize=8)
    axes.set_title("Slowest hosts (p99 lateness, worst at the top)", loc="left", fontsize=11)
    return _png(figure)


def chart_heatmap(by_host_hour: pd.DataFrame, by_host: pd.DataFrame) -> str | None:
    frame = by_host_hour[by_host_hour["fires"] > 0] if not by_host_hour.empty else by_host_hour
    if frame.empty:
        return None
    import numpy as np
    from matplotlib.colors import LogNorm

    plt = _pyplot()
    order = (
        by_host[by_host["fires"] > 0]
        .sort_values(["p99_ms", "max_ms", "host"], ascending=[False, False, True])["host"]
        .head(HEATMAP_HOSTS)
        .tolist()
    )
    grid = frame[frame["host"].isin(order)].pivot(index="host", columns="hour_ms", values="p99_ms")
    grid = grid.reindex(order)
    values = grid.to_numpy(dtype=float) + 1.0
    figure, axes = plt.subplots(layout="constrained", figsize=(10, 0.28 * len(order) + 1.6))
    finite = values[np.isfinite(values)]
    image = axes.imshow(
        np.ma.masked_invalid(values),
        aspect="auto",
        cmap="magma_r",
        norm=LogNorm(vmin=max(1.0, finite.min()), vmax=max(2.0, finite.max())),
        interpolation="nearest",
    )
    axes.set_yticks(range(len(order)), order)
    hours = [dt.datetime.fromtimestamp(h / 1000, dt.timezone.utc).strftime("%d %H:00") for h in grid.columns]
    step = max(1, len(hours) // 12)
    axes.set_xticks(range(0, len(hours), step), hours[::step], rotation=45, ha="right")
    colorbar = figure.colorbar(image, ax=axes, pad=0.01)
    colorbar.set_label("p99 lateness + 1 (ms)")
    axes.set_title("p99 lateness by host and hour (UTC), worst hosts at the top", loc="left", fontsize=11)
    return _png(figure)


def chart_timeout_rate(by_group: pd.DataFrame) -> str | None:
    frame = by_group.dropna(subset=["timeout_rate"]) if not by_group.empty else by_group
    if frame.empty:
        return None
    plt = _pyplot()
    frame = frame.sort_values("timeout_rate").tail(30)
    figure, axes = plt.subplots(layout="constrained", figsize=(10, 0.32 * len(frame) + 1.2))
    positions = range(len(frame))
    axes.barh(positions, 100 * frame["timeout_rate"], color=PALETTE["fires"])
    for position, (_, row) in zip(positions, frame.iterrows()):
        axes.text(
            100 * row["timeout_rate"] + 1, position,
            f"{_fmt_count(row['fired'])} fired / {_fmt_count(row['cancelled_hit'])} completed",
            va="center", fontsize=8,
        )  # fmt: skip
    axes.set_yticks(list(positions), frame["group"])
    axes.set_xlim(0, 125)
    axes.set_xlabel("timeout rate (%): fired / (fired + cancelled before deadline)")
    axes.grid(alpha=0.3, axis="x")
    axes.set_title("Which groups time out instead of completing", loc="left", fontsize=11)
    return _png(figure)


def chart_idle_churn(idle: pd.DataFrame) -> str | None:
    frame = idle[(idle["idle_rearms"] + idle["idle_fires"]) > 0] if not idle.empty else idle
    if frame.empty:
        return None
    plt = _pyplot()
    frame = frame.sort_values("idle_rearms", ascending=True).tail(20)
    figure, axes = plt.subplots(layout="constrained", figsize=(10, 0.5 * len(frame) + 1.8))
    positions = list(range(len(frame)))
    axes.barh([p + 0.2 for p in positions], frame["idle_rearms"], height=0.4, color=PALETTE["rearms"],
              label="re-armed (key was touched)")
    axes.barh([p - 0.2 for p in positions], frame["idle_fires"], height=0.4, color=PALETTE["fires"],
              label="fired (really idle)")
    for position, (_, row) in zip(positions, frame.iterrows()):
        ratio = row["rearms_per_fire"]
        label = "no idle fire" if pd.isna(ratio) else f"{ratio:.1f} re-arms per fire"
        axes.text(max(row["idle_rearms"], row["idle_fires"]) * 1.01, position, label, va="center", fontsize=8)
    axes.set_yticks(positions, frame["group"])
    axes.set_xlabel("idle-timer wake-ups")
    axes.grid(alpha=0.3, axis="x")
    figure.legend(loc="outside lower center", frameon=False, ncol=2, fontsize=8)
    axes.set_title("Idle-timer wake-ups: key touched (re-armed) vs really idle (fired)", loc="left", fontsize=11)
    return _png(figure)


def chart_noisiest_groups(noisy: pd.DataFrame) -> str | None:
    if noisy.empty:
        return None
    plt = _pyplot()
    frame = noisy.sort_values("rank", ascending=False)
    figure, axes = plt.subplots(layout="constrained", figsize=(10, 0.32 * len(frame) + 1.2))
    positions = range(len(frame))
    left = pd.Series(0, index=frame.index, dtype=float)
    for column in ("adds", "rearms", "cancels", "fires", "acks", "idle_rearms"):
        if column not in frame:
            continue
        axes.barh(positions, frame[column], left=left, color=PALETTE[column], label=column.replace("_", " "))
        left = left + frame[column]
    axes.set_yticks(list(positions), [f"{g} ({h} hosts)" for g, h in zip(frame["group"], frame["hosts"])])
    axes.set_xlabel("events")
    axes.grid(alpha=0.3, axis="x")
    figure.legend(loc="outside lower center", frameon=False, ncol=6, fontsize=8)
    axes.set_title("Noisiest groups", loc="left", fontsize=11)
    return _png(figure)


def chart_replication(replication: pd.DataFrame, bucket_width_ms: int) -> str | None:
    """Highest replication lag (ms) per host id and bucket; the buckets where a daemon was
    behind, failed or fenced are marked (the worst state of the bucket)."""
    if replication.empty:
        return None
    plt = _pyplot()
    width = fmt_width(bucket_width_ms)
    worst = replication.groupby("host_id")["lag_max_ms"].max().sort_values(ascending=False, kind="stable")
    shown = worst.head(REPLICATION_HOSTS).index.tolist()
    figure, axes = plt.subplots(layout="constrained", figsize=(10, 3.6))
    for host_id in shown:
        rows = replication[replication["host_id"] == host_id].sort_values("bucket_ms")
        axes.plot(_times(rows["bucket_ms"]), rows["lag_max_ms"].astype(float) + 1, lw=1.1, drawstyle="steps-post",
                  label=str(host_id))
    for state in ("behind", "failed", "fenced"):
        marked = replication[replication["host_id"].isin(shown) & (replication["worst_state"] == state)]
        if not marked.empty:
            axes.scatter(_times(marked["bucket_ms"]), marked["lag_max_ms"].astype(float) + 1, s=18, zorder=3,
                         color=PALETTE[state], marker="v" if state == "fenced" else "o", label=state)
    axes.set_yscale("log")
    axes.set_ylabel("lag + 1 (ms, log)")
    axes.set_xlabel(f"time (UTC), {width} buckets")
    axes.grid(alpha=0.3, which="both")
    figure.legend(loc="outside lower center", frameon=False, ncol=min(8, len(shown) + 3), fontsize=8)
    more = f", the {len(shown)} with the highest" if len(worst) > len(shown) else ""
    axes.set_title(f"Replication lag to the fleet's stream, max per {width} bucket (host ids{more})", loc="left",
                   fontsize=11)
    figure.autofmt_xdate()
    return _png(figure)


def replication_incidents(replication: pd.DataFrame) -> pd.DataFrame:
    """The buckets of the replication table not spent replicating throughout, worst first
    (most time behind, failed or fenced, then the highest lag)."""
    if replication.empty:
        return replication
    rows = replication[replication["worst_state"] != "replicating"].copy()
    rows["_bad_ms"] = rows["behind_ms"] + rows["failed_ms"] + rows["fenced_ms"]
    order = rows.sort_values(["_bad_ms", "lag_max_ms", "host_id", "bucket_ms"], ascending=[False, False, True, True],
                             kind="stable")
    return order.drop(columns="_bad_ms").reset_index(drop=True)


def chart_bad_input(segments: pd.DataFrame) -> str | None:
    columns = ["torn_tail", "checksum_mismatch", "unsupported_version", "bad_json"]
    if segments.empty or int(segments[columns].to_numpy().sum()) == 0:
        return None
    plt = _pyplot()
    totals = segments[columns].sum()
    figure, axes = plt.subplots(layout="constrained", figsize=(10, 1.9))
    axes.barh(range(len(columns)), totals.values, color="#C44E52")
    axes.set_yticks(range(len(columns)), [c.replace("_", " ") for c in columns])
    for position, value in enumerate(totals.values):
        axes.text(value, position, f" {int(value)}", va="center", fontsize=8)
    axes.set_xlabel("lines skipped")
    axes.set_title("Bad input by reason (skipped, never counted in the figures)", loc="left", fontsize=11)
    return _png(figure)


# --------------------------------------------------------------------------- #
# HTML
# --------------------------------------------------------------------------- #

_CSS = """
body{font:14px/1.45 -apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px auto;\
max-width:1100px;color:#222;padding:0 16px}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:32px 0 6px;border-bottom:1px solid #ddd;padding-bottom:4px}
.sub{color:#666;margin-bottom:18px}
.cards{display:flex;flex-wrap:wrap;gap:10px}
.card{border:1px solid #ddd;border-radius:8px;padding:10px 14px;min-width:130px}
.card .v{font-size:22px;font-weight:600} .card .l{color:#666;font-size:12px}
.card.bad{border-color:#C44E52;background:#fdf1f1} .card.bad .v{color:#C44E52}
.how{color:#555;margin:2px 0 8px}
img{max-width:100%}
table{border-collapse:collapse;font-size:12px;margin:6px 0}
td,th{border:1px solid #e3e3e3;padding:3px 7px;text-align:right} th{background:#f6f6f6}
td:first-child,th:first-child{text-align:left}
details{margin:6px 0} summary{cursor:pointer;color:#345}
.muted{color:#888}
"""


def _card(label: str, value: str, bad: bool = False) -> str:
    klass = "card bad" if bad else "card"
    return (f'<div class="{klass}"><div class="v">{html.escape(value)}</div>'
            f'<div class="l">{html.escape(label)}</div></div>')


def _img(png: str | None, alt: str) -> str:
    if png is None:
        return '<p class="muted">No data for this chart.</p>'
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{png}">'


def _table(frame: pd.DataFrame, rows: int = 20, title: str = "table") -> str:
    if frame.empty:
        return ""
    shown = frame.head(rows).copy()
    for column in shown.columns:
        if column.endswith(("bucket_ms", "minute_ms", "hour_ms")):
            shown[column] = shown[column].map(_fmt_time)
        elif column == "timeout_rate":
            shown[column] = shown[column].map(_fmt_rate)
        elif column.endswith("_per_s") or column == "rearms_per_fire":
            shown[column] = shown[column].map(lambda v: "–" if pd.isna(v) else f"{v:.2f}")
    more = f" (first {rows} of {len(frame)})" if len(frame) > rows else ""
    body = shown.to_html(index=False, na_rep="–", border=0, escape=True)
    return f"<details><summary>{html.escape(title)}{more}</summary>{body}</details>"


def render(
    out_dir: str,
    tables: Mapping[str, Any],
    summary: Mapping[str, Any],
    run_info: Mapping[str, Any] | None = None,
) -> str:
    """Write ``out_dir/report.html`` from the figure tables; return its path."""
    run_info = dict(run_info or {})
    frames = {name: _frame(table) for name, table in tables.items()}
    empty = pd.DataFrame()
    get = lambda name: frames.get(name, empty)  # noqa: E731
    segments = get("segments")
    width_ms = int(summary.get("bucket_width_ms") or 60_000)
    width = fmt_width(width_ms)

    bad_lines = int(summary.get("bad_lines") or 0)
    damaged = int(summary.get("damaged_segments") or 0)
    unreadable = int(summary.get("unreadable_segments") or 0)
    span = "–"
    if summary.get("first_ms") is not None and summary.get("last_ms") is not None:
        hours = (summary["last_ms"] - summary["first_ms"]) / 3_600_000
        span = f"{hours:.1f} h" if hours >= 1 else f"{hours * 60:.0f} min"
    cards = "".join([
        _card("events", _fmt_count(summary.get("events"))),
        _card("hosts", _fmt_count(summary.get("hosts"))),
        _card("groups", _fmt_count(summary.get("groups"))),
        _card("time span", span),
        _card("p50 lateness", _fmt_ms(summary.get("p50_ms"))),
        _card("p99 lateness", _fmt_ms(summary.get("p99_ms"))),
        _card("p99.9 lateness", _fmt_ms(summary.get("p999_ms"))),
        _card("max lateness", _fmt_ms(summary.get("max_ms"))),
        _card("timeout rate", _fmt_rate(summary.get("timeout_rate"))),
        _card("overdue after downtime", _fmt_count(summary.get("overdue_fires")),
              bad=bool(summary.get("overdue_fires"))),
        _card("bad lines skipped", _fmt_count(bad_lines), bad=bad_lines > 0),
        _card("damaged segments", str(damaged), bad=damaged > 0),
        _card("unreadable segments", str(unreadable), bad=unreadable > 0),
    ])  # fmt: skip
    if summary.get("repl_hosts"):
        fenced = int(summary.get("repl_fenced_hosts") or 0)
        cards += "".join([
            _card("replicating hosts", _fmt_count(summary.get("repl_hosts"))),
            _card("max replication lag", _fmt_ms(summary.get("repl_lag_max_ms"))),
            _card("time behind the stream", _fmt_ms(summary.get("repl_behind_ms"))),
            _card("hosts fenced", str(fenced), bad=fenced > 0),
        ])  # fmt: skip

    sections = [
        ("Load over time",
         f"Adds, cancels and fires per second, averaged per {width} bucket (the width is chosen from the "
         "time span: at most 300 buckets), all hosts together.",
         _img(chart_throughput(get("throughput_over_time"), width_ms), "throughput"),
         _table(get("throughput_over_time"), title="throughput_over_time")),
        ("How late timers fire",
         f"Lateness = fired wall time - deadline, for timers fired by a running daemon "
         f"(timers overdue after downtime are counted separately), per {width} bucket. "
         "Exact nearest-rank percentiles.",
         _img(chart_lateness_over_time(get("lateness_over_time"), width_ms), "lateness over time"),
         _table(get("lateness_by_group"), title="lateness_by_group")),
        ("Slowest hosts",
         "Hosts ranked by p99 lateness; the dot is the median, the tick the worst fire.",
         _img(chart_slowest_hosts(get("slowest_hosts")), "slowest hosts"),
         _table(get("slowest_hosts"), title="slowest_hosts")),
        ("Which hosts fall behind, and when",
         "p99 lateness per host and hour; darker is later. Blank cells: no fires that hour.",
         _img(chart_heatmap(get("lateness_by_host_hour"), get("lateness_by_host")), "heat map"),
         _table(get("lateness_by_host_group"), title="lateness_by_host_group")),
        ("Timeout rate by group",
         "Of the operations armed and ended, the share that timed out rather than completed "
         "(a cancel that removed a pending timer = completed before its deadline).",
         _img(chart_timeout_rate(get("timeout_rate_by_group")), "timeout rate"),
         _table(get("timeout_rate_by_host"), title="timeout_rate_by_host")),
        ("Idle-timeout churn",
         "Idle timers are re-armed lazily: a wake-up that finds the key touched moves the timer "
         "(re-armed); a wake-up that finds it idle fires. Many re-arms per fire = wake-ups spent on busy keys.",
         _img(chart_idle_churn(get("idle_churn_by_group")), "idle churn"),
         _table(get("idle_churn_by_group"), title="idle_churn_by_group")),
        ("Noisiest groups",
         "Timer events per group, by type, across the fleet.",
         _img(chart_noisiest_groups(get("noisiest_groups")), "noisiest groups"),
         _table(get("noisiest_groups"), title="noisiest_groups")),
        ("Replication to the fleet's stream",
         f"Daemons run with --replicate journal the state of their replication (every 10 s and at every "
         f"change): how many journaled events the stream had not stored yet, and for how long. Highest lag per "
         f"host id and {width} bucket; marks: buckets with time behind the stream (cluster out of reach), a "
         "failed replicator, or a host fenced (a peer took its timers over).",
         _img(chart_replication(get("replication"), width_ms), "replication lag"),
         _table(replication_incidents(get("replication")),
                title="replication: buckets not replicating throughout, worst first")),
    ]  # fmt: skip

    bad_segments = segments[segments["status"] != "ok"] if not segments.empty else segments
    quality_text = (
        f"{len(segments)} segment files, {_fmt_count(summary.get('lines'))} lines; "
        f"{bad_lines} bad lines skipped, {damaged} damaged and {unreadable} unreadable segments."
    )
    quality = [
        _img(chart_bad_input(segments), "bad input") if bad_lines else "",
        (
            bad_segments.to_html(index=False, na_rep="–", border=0)
            if not bad_segments.empty
            else '<p class="muted">Every segment read cleanly.</p>'
        ),
    ]

    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        "<title>wheeld fleet report</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>wheeld fleet report</h1>",
        f"<div class='sub'>{html.escape(_fmt_time(summary.get('first_ms')))} – "
        f"{html.escape(_fmt_time(summary.get('last_ms')))} · "
        f"journals: {html.escape(str(run_info.get('journal_path', '?')))}</div>",
        f"<div class='cards'>{cards}</div>",
    ]
    for title, how, image, table in sections:
        parts += [f"<h2>{html.escape(title)}</h2>", f"<p class='how'>{html.escape(how)}</p>", image, table]
    parts += [
        "<h2>Input quality</h2>",
        f"<p class='how'>{html.escape(quality_text)} Bad lines never reach the figures.</p>",
        *quality,
        "<h2>Run</h2>",
        f"<pre>{html.escape(json.dumps(run_info, indent=2, default=str))}</pre>",
        "</body></html>",
    ]
    path = os.path.join(out_dir, "report.html")
    with open(path, "w", encoding="utf-8") as file:
        file.write("\n".join(parts))
    return path


def render_from_dir(out_dir: str) -> str:
    """Re-draw ``OUT/report.html`` from ``OUT/tables`` and ``OUT/summary.json`` (no Spark)."""
    tables_dir = os.path.join(out_dir, "tables")
    tables = {
        name: pd.read_parquet(os.path.join(tables_dir, name))
        for name in sorted(os.listdir(tables_dir))
        if name != "events" and os.path.isdir(os.path.join(tables_dir, name))
    }
    with open(os.path.join(out_dir, "summary.json")) as file:
        saved = json.load(file)
    return render(out_dir, tables, saved["summary"], saved.get("run"))


if __name__ == "__main__":
    print(render_from_dir(sys.argv[1]))
