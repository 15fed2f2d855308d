"""bench.delivery with a short run: both paths run, and deliver the same."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _child(path: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "bench.delivery", "--child", path, "--ms", "700"], cwd=ROOT,
                         capture_output=True, text=True, check=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_both_paths_fire_and_deliver_the_same_timers():
    """The seeded workload is the same on both paths: each delivers every timer that came
    due (each is released only once its frame went out), as many per ms."""
    checked, c = _child("checked"), _child("C")
    assert checked["path"] == "checked" and c["path"] == "C"
    assert checked["fired_per_ms"] == c["fired_per_ms"] > 0
    assert checked["us_per_ms"] > 0 and c["us_per_ms"] > 0
