"""The width of the report's time buckets, chosen from the journal's time span (no Spark here:
tests/test_pipeline.py holds the Spark job's tables equal to the reference's)."""

from __future__ import annotations

import pytest

pytest.importorskip("pandas", reason="the report needs the pipeline extra (pip install -e '.[pipeline]')")

from wheeld.pipeline import reference  # noqa: E402
from wheeld.pipeline.report import fmt_width  # noqa: E402

MINUTE, HOUR, DAY = 60_000, 3_600_000, 86_400_000
T0 = 1_700_000_000_000


@pytest.mark.parametrize(
    "span_ms, width_ms",
    [
        (0, 1_000),  # one event
        (90_000, 1_000),  # 90 s: 91 one-second points (never under 1 s)
        (4 * MINUTE, 1_000),
        (5 * MINUTE, 2_000),  # 301 one-second buckets would be one too many
        (10 * MINUTE, 5_000),
        (30 * MINUTE, 10_000),
        (HOUR, 15_000),
        (6 * HOUR, 2 * MINUTE),
        (DAY, 5 * MINUTE),
        (7 * DAY, HOUR),
        (90 * DAY, 12 * HOUR),
        (3 * 365 * DAY, DAY),  # longer than 300 days: the widest width, more points
    ],
)
def test_bucket_width_follows_the_span(span_ms, width_ms):
    first = T0 + 12_345
    assert reference.bucket_width_ms(first, first + span_ms) == width_ms
    points = (first + span_ms) // width_ms - first // width_ms + 1
    assert points <= reference.MAX_BUCKETS or width_ms == reference.BUCKET_WIDTHS_MS[-1]
    if span_ms >= 100_000 and width_ms != reference.BUCKET_WIDTHS_MS[-1]:
        assert points >= 100  # 100-300 points whenever the span allows it


def test_every_width_divides_a_day_and_no_input_gives_the_narrowest():
    assert all(DAY % width == 0 for width in reference.BUCKET_WIDTHS_MS)
    assert list(reference.BUCKET_WIDTHS_MS) == sorted(reference.BUCKET_WIDTHS_MS)
    assert reference.bucket_width_ms(None, None) == 1_000


def test_width_labels():
    assert ([fmt_width(w) for w in (1_000, 15_000, 2 * MINUTE, 6 * HOUR, DAY)]
            == ["1 s", "15 s", "2 min", "6 h", "1 day"])


def test_a_few_minutes_of_journal_get_second_buckets_and_per_second_rates(tmp_path):
    from wheeld.journal.files import Journal
    from wheeld.pipeline import report
    from wheeld.protocol.journal import Add, Fire

    with Journal(tmp_path / "host-a", fsync="off", host="host-a") as journal:
        for second in range(180):  # three minutes, 4 adds and 1 fire a second
            t = T0 + second * 1_000
            journal.append([Add(t=t + j, g="g", k=f"k{second}-{j}", d=t + 500, s=j) for j in range(4)])
            journal.append([Fire(t=t + 500, g="g", k=f"k{second}-0", d=t + 500, s=0, f=t + 500, lat=0)])
    tables = reference.compute(str(tmp_path))
    assert tables["summary"][0]["bucket_width_ms"] == 1_000
    throughput = tables["throughput_over_time"]
    assert len(throughput) == 180 and all(row["adds"] == 4 and row["adds_per_s"] == 4.0 for row in throughput)
    assert len(tables["lateness_over_time"]) == 180
    html = open(report.render(str(tmp_path), tables, tables["summary"][0])).read()
    assert "averaged per 1 s bucket" in html
