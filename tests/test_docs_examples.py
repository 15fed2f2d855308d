"""Every Python block in docs/use-cases.md, the README's worker snippet, and
examples/purgatory_fetch.py, run as they are.

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


def test_readme_worker_snippet(daemon, tmp_path):
    """The README's snippet gets both of its expirations, and leaves nothing behind for the
    next run of it (a timer still pending at the end would be delivered to the next run)."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Using it from a worker"):]
    snippet = re.search(r"^```python\n(.*?)^```", section, flags=re.S | re.M).group(1)
    script = tmp_path / "readme_worker.py"
    script.write_text(snippet)
    for _ in range(2):
        out = run([str(script)], daemon, timeout_s=30)
        assert out.returncode == 0, out.stderr
        keys = [line.split()[0] for line in out.stdout.splitlines()]
        assert keys == ["req-18", "sock-3"], out.stdout


@pytest.mark.parametrize("backend", ["in-process", "daemon"])
def test_purgatory_fetch_example(backend, daemon):
    args = [str(ROOT / "examples" / "purgatory_fetch.py")]
    if backend == "daemon":
        args += ["--daemon", daemon.socket_path]
    out = run(args, daemon)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "fetch-quiet: timed out, 0 bytes" in out.stdout and "fetch-at-close: error:" in out.stdout
