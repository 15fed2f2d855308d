"""The Makefile's install steps work in a venv whoever made it.

The installs build without isolation (``pip install --no-build-isolation``: the
compiled hot path is built with the venv's own Cython), so the venv must hold
pyproject.toml's ``[build-system] requires``. A venv made by hand (``python3 -m venv
.venv && .venv/bin/pip install -e '.[test]'``: pip's isolated build brings Cython for
that install only) has none of them; the Makefile installs them first.

The default run checks the plan (``make -n``: the build requirements are installed
before any install without isolation, for every target that installs); the slow
variants run the step that installs them into a throwaway venv, and the whole
install in a copy of the tree. CI runs the step for real on every run: ``make
test-core`` makes each extra interpreter's venv the plain way, without Cython.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BUILD_REQUIRES = tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]["requires"]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def make(*args: str, cwd: Path = REPO, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MAKE", "MFLAGS"))}
    return subprocess.run(["make", "--no-print-directory", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env)


def hand_made_venv(path: Path, with_pip: bool) -> Path:
    """``python3 -m venv PATH`` as a person types it: nothing installed in it but (maybe) pip."""
    subprocess.run([sys.executable, "-m", "venv", *([] if with_pip else ["--without-pip"]), str(path)], check=True,
                   timeout=300, capture_output=True)
    return path


@pytest.mark.parametrize("target,extras", [("install", "-e ."), ("test", "-e '.[test,bench,pipeline]'"),
                                           ("test-core", "-e '.[test]'")])
def test_every_install_in_a_hand_made_venv_gets_the_build_requirements_first(tmp_path, target, extras):
    venv = hand_made_venv(tmp_path / "venv", with_pip=False)
    plan = make("-n", target, f"VENV={venv}")
    assert plan.returncode == 0, plan.stderr
    lines = plan.stdout.splitlines()
    install = next((i for i, line in enumerate(lines) if "--no-build-isolation" in line and line.endswith(extras)),
                   None)
    assert install is not None, f"make {target} does not install {extras}:\n{plan.stdout}"
    requirements = [i for i, line in enumerate(lines) if "pip install" in line and "build-requirements.txt" in line]
    assert requirements and requirements[0] < install, \
        f"make {target} builds without isolation in a venv it did not give the build requirements:\n{plan.stdout}"


@pytest.mark.slow  # pip installs setuptools, wheel and Cython: one to two minutes on a loaded machine
def test_the_build_requirements_step_installs_them_into_a_hand_made_venv(tmp_path):
    venv = hand_made_venv(tmp_path / "venv", with_pip=True)
    python = str(venv / "bin" / "python")
    assert subprocess.run([python, "-c", "import Cython"], capture_output=True).returncode != 0  # as made by hand
    done = make("build-requirements", f"VENV={venv}", timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (venv / "build-requirements.txt").read_text().split() == BUILD_REQUIRES
    check = subprocess.run([python, "-c", "import Cython, setuptools; print(Cython.__version__)"], capture_output=True,
                           text=True)
    assert check.returncode == 0, check.stderr
    again = make("-q", "build-requirements", f"VENV={venv}")  # the stamp: done once per pyproject.toml
    assert again.returncode == 0, again.stdout + again.stderr


@pytest.mark.slow
def test_make_install_in_a_hand_made_venv_of_a_copy(tmp_path):
    """The whole install (the compiled hot path included) into a venv made by hand and given
    only what a person's ``pip install -e .`` leaves in it, in a copy of the tree."""
    copy = tmp_path / "wheeld"
    files = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True, check=True).stdout
    for name in files.decode().split("\0"):
        if name and (REPO / name).is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, copy / name)
    venv = hand_made_venv(copy / ".venv", with_pip=True)
    done = make("install", cwd=copy, timeout=1800)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    check = subprocess.run([str(venv / "bin" / "python"), "-c",
                            "from wheeld.protocol import accel; print(accel.implementation())"],
                           capture_output=True, text=True, cwd=tmp_path)
    assert check.returncode == 0 and check.stdout.strip() == "compiled", check.stdout + check.stderr
