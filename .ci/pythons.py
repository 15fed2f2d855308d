"""The Python versions the project claims, and an interpreter for each on this machine.

The claim is pyproject.toml's: ``requires-python`` and the ``Programming Language ::
Python :: 3.N`` classifiers, which list every supported minor version (the lowest of
them must be the one ``requires-python`` names). For each, an interpreter is looked
for as ``python3.N`` on ``$PATH`` (a pyenv shim that cannot run it does not count),
then in pyenv's versions folder (``$PYENV_ROOT``, else ``~/.pyenv``: the newest
``3.N.*`` there), then ``/usr/bin/python3.N`` and ``/usr/local/bin/python3.N``.

    python3 .ci/pythons.py [--except VERSION]

prints one line ``3.N PATH`` per claimed version (``--except`` leaves one out: the
version ``make test`` already ran on) and exits 0; when an interpreter is missing it
prints every version it found, then on stderr which ones are missing and where it
looked, and exits 1: a CI run must not pass while a claimed version went untested.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_CLASSIFIER = re.compile(r"Programming Language :: Python :: (3\.\d+)$")


def claimed_versions(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """The minor versions pyproject.toml's classifiers list, checked against requires-python."""
    project = tomllib.loads(pyproject.read_text())["project"]
    versions = sorted({m.group(1) for c in project.get("classifiers", []) if (m := _CLASSIFIER.match(c))},
                      key=lambda v: tuple(map(int, v.split("."))))
    if not versions:
        raise SystemExit(f"{pyproject}: no 'Programming Language :: Python :: 3.N' classifier says which "
                         "Python versions the project supports")
    floor = re.fullmatch(r">=\s*(3\.\d+)", project.get("requires-python", "").strip())
    if floor is None or floor.group(1) != versions[0]:
        raise SystemExit(f"{pyproject}: requires-python {project.get('requires-python')!r} does not start at the "
                         f"lowest classified version {versions[0]}")
    return versions


def _runs_as(path: str, version: str) -> bool:
    """``path`` runs and is Python ``version``."""
    try:
        out = subprocess.run([path, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and out.stdout.strip() == version


def candidates(version: str, pyenv_root: Path | None = None) -> list[str]:
    """Where an interpreter for ``version`` may be, in the order they are tried."""
    found = []
    on_path = shutil.which(f"python{version}")
    if on_path:
        found.append(on_path)
    root = pyenv_root or Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv")
    patch = re.compile(rf"{re.escape(version)}\.(\d+)$")
    installed = sorted((int(m.group(1)), entry) for entry in (root / "versions").glob(f"{version}.*")
                       if (m := patch.match(entry.name)))
    found += [str(entry / "bin" / f"python{version}") for _, entry in reversed(installed)]
    found += [f"/usr/bin/python{version}", f"/usr/local/bin/python{version}"]
    return found


def find(version: str, pyenv_root: Path | None = None) -> str | None:
    """An interpreter of ``version`` that runs, or None."""
    return next((path for path in candidates(version, pyenv_root) if _runs_as(path, version)), None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--except", dest="skip", default=None, metavar="VERSION",
                        help="leave this version out (3.N)")
    parser.add_argument("--pyenv-root", type=Path, default=None,
                        help="pyenv's folder (default $PYENV_ROOT or ~/.pyenv)")
    parser.add_argument("--pyproject", type=Path, default=ROOT / "pyproject.toml", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    missing = []
    for version in claimed_versions(args.pyproject):
        if version == args.skip:
            continue
        path = find(version, args.pyenv_root)
        if path is None:
            missing.append(version)
        else:
            print(version, path, flush=True)
    for version in missing:
        print(f"pythons: NO INTERPRETER for Python {version}, which pyproject.toml claims; looked at "
              f"{', '.join(candidates(version, args.pyenv_root))} (install it, e.g. `pyenv install {version}`)",
              file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
