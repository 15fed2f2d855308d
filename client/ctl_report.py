"""``wheelctl report JOURNAL_DIR --out DIR [--master URL]``: the fleet report.

A thin click shell over :func:`wheeld.pipeline.job.run` (uvicorn's CLI is
the model: parse options, build the call, run it). ``wheelctl`` registers
this command; PySpark is imported only when the command runs, so the rest of
``wheelctl`` starts fast and works without the ``pipeline`` extra.

With no ``--master`` Spark starts embedded in this process as ``local[*]``;
the only set-up is ``pip install 'wheeld[pipeline]'`` and a Java 17+ runtime.
Stage progress (counts and elapsed time per stage) goes to stderr; the last
line on stdout says where the report is.
"""

from __future__ import annotations

import shutil
import sys

import click


@click.command("report", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("journal_dir")
@click.option("--out", required=True, metavar="DIR", help="Output directory: report.html, summary.json, tables/.")
@click.option("--master", default=None, metavar="URL",
              help="Spark master (spark://host:7077, yarn, k8s://...). Default: local[*], embedded.")
@click.option("--tables", "tables_dir", default=None, metavar="URL",
              help="Where executors write the Parquet tables (default OUT/tables; on a multi-machine "
                   "cluster, storage every executor can write).")
@click.option("--top", "top_n", type=click.IntRange(1, 10_000), default=20, show_default=True,
              help="Rows in the slowest-hosts and noisiest-groups rankings.")
@click.option("-q", "--quiet", is_flag=True, help="No stage progress on stderr.")
def report(journal_dir: str, out: str, master: str | None, tables_dir: str | None = None,
           top_n: int = 20, quiet: bool = False) -> None:
    """Analyse the journals under JOURNAL_DIR (one folder per host) with Spark.

    Writes Parquet tables (lateness percentiles per host/group/minute, load,
    timeout rate, idle churn, slowest hosts, noisiest groups, bad input) and
    a self-contained HTML report with charts.
    """  # fmt: skip
    try:
        from wheeld.pipeline import job
    except ImportError as exc:  # pyspark, pandas or pyarrow missing
        raise click.ClickException(
            f"the report needs the pipeline extra: pip install 'wheeld[pipeline]' ({exc})"
        ) from exc
    if shutil.which("java") is None and not _java_home_set():
        raise click.ClickException("the report runs Spark, which needs Java 17+ (no 'java' on PATH, no JAVA_HOME)")
    from wheeld.protocol.errors import InvalidRequest

    job.configure_logging(verbose=not quiet)
    try:
        result = job.run(journal_dir, out, master, tables_dir=tables_dir, top_n=top_n, progress=not quiet)
    except InvalidRequest as exc:
        raise click.ClickException(str(exc)) from exc
    summary = result.summary
    click.echo(
        f"{summary['events']} events from {summary['hosts']} hosts in {summary['segments']} segments; "
        f"{summary['bad_lines']} bad lines skipped ({summary['damaged_segments']} damaged, "
        f"{summary['unreadable_segments']} unreadable segments)"
    )
    click.echo(f"report: {result.report_path}")


def _java_home_set() -> bool:
    import os

    home = os.environ.get("JAVA_HOME")
    return bool(home) and os.path.exists(os.path.join(home, "bin", "java"))


if __name__ == "__main__":  # pragma: no cover - wheelctl registers the command
    sys.exit(report())
