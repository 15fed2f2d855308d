"""Every Python block in docs/use-cases.md, and examples/purgatory_fetch.py, runs as it is.

Each block is written to a file and run in a fresh interpreter with
``WHEELD_SOCKET`` pointing at a real daemon (the ``daemon`` fixture, killed and
its segments unlinked afterwards); it must exit 0 within the timeout.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "use-cases.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", DOC.read_text(), flags=re.S | re.M)


def run(args: list[str], daemon, timeout_s: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, WHEELD_SOCKET=daemon.socket_path)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout_s, env=env,
                          cwd=ROOT)


def test_the_doc_has_examples():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_doc_example_runs(index, daemon, tmp_path):
    script = tmp_path / f"use_cases_{index}.py"
    script.write_text(BLOCKS[index])
    out = run([str(script)], daemon)
    assert out.returncode == 0, f"block {index} failed:\n{BLOCKS[index]}\n--- stderr:\n{out.stderr}"


@pytest.mark.parametrize("backend", ["in-process", "daemon"])
def test_purgatory_fetch_example(backend, daemon):
    args = [str(ROOT / "examples" / "purgatory_fetch.py")]
    if backend == "daemon":
        args += ["--daemon", daemon.socket_path]
    out = run(args, daemon)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "fetch-quiet: timed out, 0 bytes" in out.stdout and "fetch-at-close: error:" in out.stdout
