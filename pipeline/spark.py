"""Where the pipeline gets its SparkSession: one factory, one set of defaults.

The same job runs in three places, and this module is the only thing that
knows the difference:

=======================  =====================================================
``wheelctl report``      no set-up beyond ``pip install 'wheeld[pipeline]'``:
                         Spark starts embedded in this process as
                         ``local[*]`` (one JVM, one executor thread per core).
``--master URL``         the driver runs here, executors on a cluster
                         (``spark://host:7077``, ``yarn``, ``k8s://...``).
``spark-submit``         spark-submit already chose the master and started
                         the JVM; we must not override it, so
                         :func:`session` leaves ``spark.master`` alone when
                         it finds ``PYSPARK_GATEWAY_PORT`` in the environment.
=======================  =====================================================

Defaults and why
----------------
``spark.sql.session.timeZone=UTC``
    The journal stores wall-clock milliseconds since the epoch; per-minute and
    per-hour buckets are computed in UTC so two operators in two time zones get
    the same tables.
``spark.sql.shuffle.partitions``
    Spark's default of 200 is sized for clusters; on a laptop every aggregation
    would schedule 200 near-empty tasks. In ``local[N]`` we use ``4 * N``
    (Adaptive Query Execution, on by default in Spark 4, coalesces further).
    On a cluster Spark's default stands unless the caller passes a number.
``spark.driver.memory``
    Only honoured before the JVM starts, so it is set here, not in the job.
    In ``local`` mode the driver is also the executor; 2 GiB holds the
    exact-percentile count maps for tens of millions of events.
``spark.sql.files.ignoreCorruptFiles`` / ``ignoreMissingFiles``
    A segment that cannot be opened or read must not abort a fleet-wide job.
    Spark then skips it silently, so the job lists the files itself and reports
    every listed file that produced no line (see ``job.py``).
``spark.ui.enabled``
    Off by default: the UI binds port 4040(+N), which collides between parallel
    test workers and is not needed for a batch report. ``ui=True`` turns it on.
``PYSPARK_PYTHON``
    Set to this interpreter so that, should a stage ever need Python workers,
    executors started on this host run the same Python with the same packages.
    The job itself is written in Spark SQL expressions only (crc check
    included), so executors never start Python: that is what lets a stock
    cluster run it without wheeld installed on the workers.

Progress on long runs: the job logs each stage with counts and elapsed time
(:class:`Stopwatch`), and ``progress=True`` keeps Spark's console progress bar
(``[Stage 3:=====>  (12 + 2) / 40]``) on stderr.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:  # pragma: no cover - typing only
    from pyspark.sql import SparkSession

log = logging.getLogger("wheeld.pipeline")

DEFAULT_MASTER = "local[*]"
DEFAULT_DRIVER_MEMORY = "2g"
APP_NAME = "wheeld-pipeline"


def launched_by_spark_submit() -> bool:
    """True when spark-submit started this Python process (it owns the master)."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


def _local_cores(master: str) -> int:
    """Number of executor threads a ``local[...]`` master string asks for."""
    inside = master[master.find("[") + 1 : master.find("]")] if "[" in master else "1"
    inside = inside.split(",")[0]
    if inside == "*":
        return os.cpu_count() or 1
    try:
        return max(1, int(inside))
    except ValueError:
        return os.cpu_count() or 1


def session(
    master: str | None = None,
    *,
    app_name: str = APP_NAME,
    shuffle_partitions: int | None = None,
    driver_memory: str | None = None,
    ui: bool = False,
    progress: bool = True,
    conf: Mapping[str, str] | None = None,
) -> "SparkSession":
    """Return the process's SparkSession, creating it with wheeld's defaults.

    ``master``: None means "``$WHEELD_SPARK_MASTER`` or ``local[*]``", except
    under spark-submit where the submitted master is kept. If a session already
    exists in this process (a test fixture, a notebook), it is returned as is:
    Spark allows one SparkContext per process and its master cannot change.
    """
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)

    builder = SparkSession.builder.appName(app_name)
    chosen = master
    if chosen is None and not launched_by_spark_submit():
        chosen = os.environ.get("WHEELD_SPARK_MASTER", DEFAULT_MASTER)
    if chosen is not None:
        builder = builder.master(chosen)

    settings: dict[str, str] = {
        "spark.sql.session.timeZone": "UTC",
        "spark.ui.enabled": "true" if ui else "false",
        "spark.ui.showConsoleProgress": "true" if progress else "false",
        "spark.sql.files.ignoreCorruptFiles": "true",
        "spark.sql.files.ignoreMissingFiles": "true",
        "spark.sql.execution.arrow.pyspark.enabled": "true",
        "spark.driver.memory": driver_memory
        or os.environ.get("WHEELD_SPARK_DRIVER_MEMORY", DEFAULT_DRIVER_MEMORY),
    }
    if shuffle_partitions is not None:
        settings["spark.sql.shuffle.partitions"] = str(shuffle_partitions)
    elif chosen is not None and chosen.startswith("local"):
        settings["spark.sql.shuffle.partitions"] = str(4 * _local_cores(chosen))
    settings.update(conf or {})
    for key, value in settings.items():
        builder = builder.config(key, value)

    started = time.monotonic()
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(os.environ.get("WHEELD_SPARK_LOG_LEVEL", "ERROR"))
    log.info(
        "spark %s session on %s ready in %.1f s",
        spark.version,
        spark.sparkContext.master,
        time.monotonic() - started,
    )
    return spark


class Stopwatch:
    """Logs pipeline stages as ``[stage] message (elapsed s, total s)``.

    The progress indication of a long run: every stage of the job reports the
    rows it produced and the time it took, so an operator watching a 10M-event
    run sees where the time goes and that it is moving.
    """

    def __init__(self, logger: logging.Logger = log) -> None:
        self._logger = logger
        self._start = time.monotonic()
        self._last = self._start
        self.stages: list[tuple[str, float]] = []

    def lap(self, stage: str, message: str = "", *args: object) -> float:
        now = time.monotonic()
        elapsed_s = now - self._last
        self._last = now
        self.stages.append((stage, elapsed_s))
        text = message % args if args else message
        self._logger.info(
            "[%s] %s (%.1f s, total %.1f s)", stage, text, elapsed_s, now - self._start
        )
        return elapsed_s

    @property
    def total_s(self) -> float:
        return time.monotonic() - self._start
