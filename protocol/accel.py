"""Which implementation of the hot path runs: compiled (Cython) or plain Python.

The hot modules listed in :data:`COMPILED_MODULES` are written in Python and
compiled by Cython into extension modules at install time (``setup.py``;
``.pxd`` files beside a module declare C types for its hot paths, the way
Cython's "pure Python mode" augments a module). The ``.py`` source is both the
executable specification and the fallback. Some ``.pxd`` files also hold C
functions that the ``.py`` calls only when compiled, twins of logic its Python
path runs in Python (docs/compiled.md lists them, each with the test that holds
it to its Python reference): a compiled module must behave exactly as its source
does, and the tests hold the two to the same bytes.

Selection:

* ``WHEELD_NO_EXTENSIONS=1`` at install time builds nothing (the Python path).
* ``WHEELD_PURE_PYTHON=1`` at run time imports the ``.py`` sources even where the
  extensions are built (:class:`_PureFinder`, installed by ``import wheeld``).
* In a source checkout an extension older than what it was built from is not
  used: its ``.py``, the ``.pxd`` beside it, and the ``.pxd`` of every hot module
  that one cimports, and the C-only ``.pxd`` files of :data:`PXD_ONLY` it cimports
  (an edit to ``shm/wheel.pxd`` or ``protocol/keycodec.pxd`` changes ``daemon/executor``
  too). The source runs, with a warning naming the newer file (``make build``
  brings the extensions up to date).

:func:`implementation` says which path runs ("compiled", "python" or "mixed");
the daemon logs it at start, publishes it (``wheelctl stats``, the Prometheus
metric ``wheeld_build_info``).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import re
import sys
import warnings

__all__ = [
    "COMPILED_MODULES", "PATH_CODES", "PATH_NAMES", "PXD_ONLY", "compiled", "implementation", "module_paths",
    "pure_python_requested", "install_finder",
]

#: module -> its source, relative to the repository (setup.py compiles each one)
COMPILED_MODULES = {
    "wheeld.shm.placement": "shm/placement.py",
    "wheeld.shm.keyindex": "shm/keyindex.py",
    "wheeld.shm.wheel": "shm/wheel.py",
    "wheeld.daemon.executor": "daemon/executor.py",
    "wheeld.daemon.frames": "daemon/frames.py",
    "wheeld.daemon.delivery": "daemon/delivery.py",
    "wheeld.daemon.core": "daemon/core.py",
    "wheeld.shm.ring": "shm/ring.py",
    "wheeld.core": "client/core.py",
    "wheeld.purgatory": "client/purgatory.py",
}

#: C declarations with no module of their own (inline functions and constants) that hot
#: modules cimport: an edit to one makes every extension that cimports it stale
PXD_ONLY = {
    "wheeld.protocol.keycodec": "protocol/keycodec.pxd",
}

#: how the daemon publishes :func:`implementation` (its ``daemon_hot_path`` counter word)
PATH_CODES = {"python": 1, "compiled": 2, "mixed": 3}
PATH_NAMES = {code: name for name, code in PATH_CODES.items()}

PURE_ENV = "WHEELD_PURE_PYTHON"
NO_EXTENSIONS_ENV = "WHEELD_NO_EXTENSIONS"


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "no", "false")


def pure_python_requested() -> bool:
    """True when ``WHEELD_PURE_PYTHON`` asks for the Python path."""
    return _flag(PURE_ENV)


def _extension_beside(directory: str, leaf: str) -> str | None:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = os.path.join(directory, leaf + suffix)
        if os.path.exists(candidate):
            return candidate
    return None


class _PureFinder(importlib.abc.MetaPathFinder):
    """Finds the ``.py`` source of a compiled module when it should not be the extension."""

    def __init__(self, pure: bool) -> None:
        self.pure = pure

    def find_spec(self, fullname, path, target=None):
        if fullname not in COMPILED_MODULES or not path:
            return None
        leaf = fullname.rpartition(".")[2]
        for directory in path:
            source = os.path.join(directory, leaf + ".py")
            if not os.path.exists(source):
                continue
            if not self.pure:
                extension = _extension_beside(directory, leaf)
                newer = None if extension is None else _stale(extension, source, directory, leaf, fullname)
                if newer is None:
                    return None  # the ordinary finders pick the extension (or the source when none)
                warnings.warn(
                    f"wheeld: {extension} is older than {newer}; running the Python source "
                    "(run `make build` to recompile)",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return importlib.util.spec_from_file_location(fullname, source)
        return None


_CIMPORT = re.compile(r"^\s*(?:from\s+([\w.]+)\s+cimport|cimport\s+([\w.]+))", re.MULTILINE)


def _stale(extension: str, source: str, directory: str, leaf: str, fullname: str | None = None) -> str | None:
    """For an in-place build (a source checkout: Cython's ``.c`` lies beside), the first of
    its inputs (:func:`_build_inputs`) newer than the extension, or None."""
    if not os.path.exists(os.path.join(directory, leaf + ".c")):
        return None  # an installed package: the extension is what was built from the source
    built = os.path.getmtime(extension)
    inputs, reached = _walk_cimports(source, fullname)
    for path in inputs:
        if os.path.getmtime(path) > built:
            return path
    # An extension built against another hot module's C types (a cimport) cannot run
    # with that module's Python source: importing it would fail ("size changed"). So
    # when a module it reaches runs from source (its extension is stale), so does it.
    for name, other_source in reached:
        other_extension = _extension_beside(os.path.dirname(other_source), name.rpartition(".")[2])
        if other_extension is None:
            continue
        other_built = os.path.getmtime(other_extension)
        for path in (other_source, other_source[:-3] + ".pxd"):  # its own inputs (its cimports are reached above)
            if os.path.exists(path) and os.path.getmtime(path) > other_built:
                return path
    return None


def _build_inputs(source: str, fullname: str | None) -> list[str]:
    """What a hot module's extension is built from: its ``.py``, the ``.pxd`` beside it,
    and, through that file's ``cimport`` lines (absolute ``wheeld.X`` or relative), the
    ``.pxd`` of every other hot module it reaches. A hot module's file is found from
    :data:`COMPILED_MODULES` (its path relative to the checkout's root)."""
    return _walk_cimports(source, fullname)[0]


def _walk_cimports(source: str, fullname: str | None) -> tuple[list[str], list[tuple[str, str]]]:
    """:func:`_build_inputs`, and the (name, ``.py`` path) of every other hot module reached."""
    root = None
    if fullname in COMPILED_MODULES:
        relative = COMPILED_MODULES[fullname]
        root = source[: len(source) - len(relative)] if source.replace(os.sep, "/").endswith(relative) else None
    inputs, queue, seen = [source], [(fullname, source[:-3] + ".pxd")], set()
    reached = []
    while queue:
        module, pxd = queue.pop()
        if pxd in seen or not os.path.exists(pxd):
            continue
        seen.add(pxd)
        inputs.append(pxd)
        if module != fullname and module is not None and module not in PXD_ONLY:
            reached.append((module, pxd[:-4] + ".py"))
        if root is None or module is None:
            continue
        with open(pxd, encoding="utf-8") as f:
            text = f.read()
        for match in _CIMPORT.finditer(text):
            name = match.group(1) or match.group(2)
            if name.startswith("."):
                name = module.rpartition(".")[0] + name  # "from .keyindex" beside "wheeld.shm.wheel"
            target = COMPILED_MODULES.get(name)
            if target is not None:
                queue.append((name, os.path.join(root, target[:-3] + ".pxd")))
            elif name in PXD_ONLY:
                queue.append((name, os.path.join(root, PXD_ONLY[name])))
    return inputs, reached


def install_finder() -> None:
    """Put the selection in front of the import system (once; ``import wheeld`` does it)."""
    if any(isinstance(finder, _PureFinder) for finder in sys.meta_path):
        return
    sys.meta_path.insert(0, _PureFinder(pure_python_requested()))


def compiled(name: str) -> bool:
    """Whether importing hot module ``name`` loads (or has loaded) its extension. Found, not
    imported: the daemon asks about the client's modules without loading them."""
    module = sys.modules.get(name)
    if module is not None:
        origin = getattr(module, "__file__", None)
    else:
        spec = importlib.util.find_spec(name)
        if spec is None:
            raise ModuleNotFoundError(f"no module named {name!r}", name=name)
        origin = spec.origin
    return (origin or "").endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))


def module_paths() -> dict[str, str]:
    """Each hot module -> "compiled" or "python": what importing it loads (or has loaded)."""
    return {name: "compiled" if compiled(name) else "python" for name in COMPILED_MODULES}


def implementation() -> str:
    """"compiled" (every hot module is an extension), "python" (none is) or "mixed"."""
    kinds = set(module_paths().values())
    return kinds.pop() if len(kinds) == 1 else "mixed"
