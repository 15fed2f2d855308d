"""Where the benchmarks write: bench/results/ holds the recorded figures (tracked by git)
and is written only with ``--save``; any other run writes under bench/runs/ (ignored by
git) or ``$WHEELD_BENCH_RUNS``. tests/test_bench_e2e_smoke.py runs one benchmark without
``--out`` and checks the recorded file is left alone."""

from __future__ import annotations

import contextlib
import importlib
import io
import subprocess
from pathlib import Path

import pytest

from bench import common

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = sorted(p.stem for p in (REPO / "bench").glob("*.py")
                    if p.stem not in ("__init__", "common", "redis_baseline", "fleet_wheeld"))
# redis_baseline: a library of e2e; fleet_wheeld: of fleet


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=30)


def test_the_default_folder_is_ignored_and_the_recorded_one_tracked(tmp_path, monkeypatch):
    monkeypatch.delenv(common.RUNS_ENV, raising=False)
    assert common.runs_dir() == common.RUNS_DIR
    if git("rev-parse", "--git-dir").returncode != 0:
        pytest.skip("not a git checkout")
    assert git("check-ignore", "-q", str(common.RUNS_DIR / "e2e.json")).returncode == 0, "bench/runs/ is not ignored"
    assert git("ls-files", "--error-unmatch", str(common.RESULTS_DIR / "e2e.json")).returncode == 0
    monkeypatch.setenv(common.RUNS_ENV, str(tmp_path / "elsewhere"))
    assert common.results_path("x.json") == tmp_path / "elsewhere" / "x.json"
    assert (tmp_path / "elsewhere").is_dir()
    assert common.results_path("x.json", save=True) == common.RESULTS_DIR / "x.json"


def test_write_json_writes_the_recorded_figures_only_when_asked(tmp_path, monkeypatch):
    monkeypatch.setenv(common.RUNS_ENV, str(tmp_path))
    path = common.write_json("probe-bench-outputs", {"figure": 1})
    assert path == tmp_path / "probe-bench-outputs.json" and path.exists()
    assert not (common.RESULTS_DIR / "probe-bench-outputs.json").exists()


@pytest.mark.parametrize("name", BENCHMARKS)
def test_every_benchmark_has_save_and_no_default_into_the_recorded_figures(name):
    """Its command line offers --save, and it builds no path into bench/results/ itself (its
    defaults come from common.results_path)."""
    module = importlib.import_module(f"bench.{name}")
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        module.main(["--help"])
    assert exit_.value.code == 0
    text = out.getvalue()
    assert "--save" in text, f"bench.{name} has no --save option:\n{text}"
    source = (REPO / "bench" / f"{name}.py").read_text()
    assert '/ "results"' not in source, f"bench/{name}.py builds a path into bench/results/ itself"
