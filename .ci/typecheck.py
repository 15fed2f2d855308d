"""Type-check ``wheeld.protocol``, ``wheeld.journal`` and the client's public modules with mypy.

Checked: the packages ``wheeld.protocol`` and ``wheeld.journal`` and the modules ``wheeld``, ``wheeld.sync``,
``wheeld.aio``, ``wheeld.core``, ``wheeld.handshake``, ``wheeld.idle``,
``wheeld.purgatory`` and ``wheeld.ctl``, with the options of pyproject.toml's
``[tool.mypy]``. What they import (``wheeld.shm``, the daemon, third-party
packages) is followed for its types, its own errors not reported
(``follow_imports = "silent"``).

The installed package ``wheeld`` is assembled from several folders (pyproject's
``package-dir``: ``client/`` is ``wheeld``, ``protocol/`` is ``wheeld.protocol``,
...). The editable install maps them with an import hook, which mypy cannot
follow (it finds modules on disk, by their dotted names). So this lays the package
out as it is installed -- a fresh temporary ``wheeld/`` holding a symbolic link to
each ``.py``, ``.pyi``, ``.pxd`` and ``py.typed`` of ``client/``, and links to the
folders of the subpackages -- runs mypy from there and removes it. Paths in the
output are the package's: ``wheeld/core.py`` is ``client/core.py``,
``wheeld/protocol/journal.py`` is ``protocol/journal.py``. Exit status: mypy's
(0: no error). Arguments are passed on to mypy.

    python .ci/typecheck.py

The compiled modules (``wheeld.core``, ``wheeld.purgatory``: Cython's pure Python
mode) call C functions that only their ``.pxd`` declares, under ``if _COMPILED:``.
Each such call carries ``# type: ignore[name-defined]`` beside its ``noqa: F821``,
rather than a ``.pyi`` stub declaring the names: a stub beside a module replaces
it for mypy, which would then no longer check the module's code at all. The
ignores are as narrow as the names, and ``warn_unused_ignores`` reports any that
is no longer needed.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: checked as a package, with every module in it
PACKAGES = ["wheeld.protocol", "wheeld.journal"]
#: the client's public modules, checked one by one
MODULES = ["wheeld", "wheeld.sync", "wheeld.aio", "wheeld.core", "wheeld.session", "wheeld.handshake", "wheeld.idle",
           "wheeld.purgatory", "wheeld.ctl"]

_LINKED_SUFFIXES = (".py", ".pyi", ".pxd")


def lay_out(package_dir: dict[str, str], into: Path) -> None:
    """Symbolic links that make ``into`` hold the package as it is installed: the top
    package's files one by one (not the C and the extensions Cython builds beside
    them), each subpackage as a link to its folder."""
    for package, source in sorted(package_dir.items()):  # parents before children
        target = into.joinpath(*package.split("."))
        if "." in package:
            target.symlink_to(ROOT / source, target_is_directory=True)
            continue
        target.mkdir(parents=True)
        for entry in sorted((ROOT / source).iterdir()):
            if entry.is_file() and (entry.suffix in _LINKED_SUFFIXES or entry.name == "py.typed"):
                (target / entry.name).symlink_to(entry)


def main(extra: list[str]) -> int:
    config = ROOT / "pyproject.toml"
    package_dir = tomllib.loads(config.read_text())["tool"]["setuptools"]["package-dir"]
    targets = [arg for package in PACKAGES for arg in ("-p", package)]
    targets += [arg for module in MODULES for arg in ("-m", module)]
    with tempfile.TemporaryDirectory(prefix="wheeld-typecheck-") as staged:
        lay_out(package_dir, Path(staged))
        command = [sys.executable, "-m", "mypy", "--config-file", str(config), *extra, *targets]
        return subprocess.run(command, cwd=staged).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
