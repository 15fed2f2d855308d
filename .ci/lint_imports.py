"""Check the import contracts of pyproject.toml ([tool.importlinter]) with import-linter.

The installed package ``wheeld`` is assembled from several folders (pyproject's
``package-dir``: ``client/`` is ``wheeld``, ``daemon/`` is ``wheeld.daemon``,
...), while import-linter reads one package from one directory. So this lays
the package out as it is installed -- a temporary ``wheeld/`` of symbolic links
to the sources, per ``package-dir`` -- and runs ``lint-imports`` on it with no
cache. Exit status: lint-imports's (0: every contract kept).

    python .ci/lint_imports.py        (or: make lint)
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def lay_out(package_dir: dict[str, str], into: Path) -> None:
    """Symbolic links that make ``into`` hold the packages as they are installed."""
    for package, source in sorted(package_dir.items()):  # parents before children
        target = into.joinpath(*package.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for entry in (ROOT / source).iterdir():
            subpackage = f"{package}.{entry.name}"
            if entry.suffix == ".py" or (entry.is_dir() and subpackage not in package_dir
                                         and (entry / "__init__.py").exists()):
                (target / entry.name).symlink_to(entry)


def main() -> int:
    config = ROOT / "pyproject.toml"
    package_dir = tomllib.loads(config.read_text())["tool"]["setuptools"]["package-dir"]
    lint = Path(sys.executable).with_name("lint-imports")
    with tempfile.TemporaryDirectory(prefix="wheeld-lint-") as staged:
        lay_out(package_dir, Path(staged))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [staged, os.environ.get("PYTHONPATH")])))
        return subprocess.run([str(lint), "--no-cache", "--no-logo", str(config)], cwd=ROOT, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
