""".ci/pythons.py: which Python versions the project claims (pyproject.toml), and an
interpreter for each, which .ci/run runs the core tests on; a claimed version with no
interpreter fails the run loudly instead of passing untested."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / ".ci" / "pythons.py"


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120,
                          env=env)


def fake_interpreter(root: Path, version: str, patch: int) -> Path:
    """A pyenv-style ``versions/3.N.P/bin/python3.N`` that answers like Python 3.N."""
    path = root / "versions" / f"{version}.{patch}" / "bin" / f"python{version}"
    path.parent.mkdir(parents=True)
    path.write_text(f"#!/bin/sh\necho {version}\n")
    path.chmod(0o755)
    return path


def test_the_claimed_versions_start_at_requires_python_and_ci_runs_each():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    claimed = [c.rsplit(" :: ", 1)[1] for c in project["classifiers"]
               if c.startswith("Programming Language :: Python :: 3.")]
    assert claimed[0] == project["requires-python"].removeprefix(">=") and len(claimed) >= 3
    ci = (REPO / ".ci" / "run").read_text()
    assert ".ci/pythons.py --except" in ci and "make test-core PYTHON=" in ci


def test_an_interpreter_is_found_in_pyenv_and_a_missing_one_fails_loudly(tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\nname = "x"\nrequires-python = ">=3.97"\nclassifiers = [\n'
                         '  "Programming Language :: Python :: 3.97",\n  "Programming Language :: Python :: 3.98",\n'
                         '  "Programming Language :: Python :: 3.99",\n]\n')
    root = tmp_path / "pyenv"
    fake_interpreter(root, "3.98", 1)
    newest = fake_interpreter(root, "3.98", 12)
    (root / "versions" / "3.99.0" / "bin").mkdir(parents=True)  # a folder without an interpreter that runs
    env = dict(os.environ, PATH=str(tmp_path / "empty"))
    done = run("--pyproject", str(pyproject), "--pyenv-root", str(root), "--except", "3.97", env=env)
    assert done.returncode == 1
    assert done.stdout.splitlines() == [f"3.98 {newest}"]
    assert "NO INTERPRETER for Python 3.99" in done.stderr and "3.97" not in done.stderr
    fake_interpreter(root, "3.99", 1)
    fine = run("--pyproject", str(pyproject), "--pyenv-root", str(root), "--except", "3.97", env=env)
    assert fine.returncode == 0 and len(fine.stdout.splitlines()) == 2, fine.stderr


def test_a_claim_below_requires_python_is_refused(tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\nname = "x"\nrequires-python = ">=3.12"\n'
                         'classifiers = ["Programming Language :: Python :: 3.11"]\n')
    done = run("--pyproject", str(pyproject))
    assert done.returncode != 0 and "requires-python" in done.stderr
