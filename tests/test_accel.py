"""Which hot path runs, how it is chosen, and how the daemon says so.

* The hot modules (``protocol/accel.py`` COMPILED_MODULES) are extensions when
  they were built and ``WHEELD_PURE_PYTHON`` is not set, their ``.py`` sources
  otherwise; an in-place build older than its source is not used.
* ``WHEELD_NO_EXTENSIONS=1`` builds a package without extensions; a build error
  fails the build (a real ``pip wheel`` of a copy of the sources, without the
  network: the build tools are the ones installed here).
* The daemon's start log, ``wheelctl stats`` (table and JSON) and the Prometheus
  text name the path of a real daemon started on each path.
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import shutil
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from daemon_harness import DaemonProcess

from wheeld.ctl import main as wheelctl_main
from wheeld.protocol import accel

ROOT = Path(__file__).resolve().parent.parent
EXTENSIONS = tuple(importlib.machinery.EXTENSION_SUFFIXES)


def _built() -> bool:
    """Every hot module has an extension beside its source."""
    return all(
        any((ROOT / source).with_suffix("").with_name(Path(source).stem + suffix).exists() for suffix in EXTENSIONS)
        for source in accel.COMPILED_MODULES.values()
    )


def _paths_in_child(env_extra: dict) -> dict:
    env = dict(os.environ, **env_extra)
    code = ("import json; from wheeld.protocol import accel; "
            "print(json.dumps([accel.module_paths(), accel.implementation()]))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True)
    paths, implementation = json.loads(out.stdout)
    return {"modules": paths, "implementation": implementation}


def test_this_process_runs_the_path_its_environment_asks_for():
    paths = accel.module_paths()
    if accel.pure_python_requested() or not _built():
        assert set(paths.values()) == {"python"}
        assert accel.implementation() == "python"
    else:
        assert set(paths.values()) == {"compiled"}, paths
        assert accel.implementation() == "compiled"
    for name, kind in paths.items():
        if name not in sys.modules:
            continue
        origin = sys.modules[name].__file__
        assert origin.endswith(EXTENSIONS) == (kind == "compiled"), (name, origin)


def test_pure_python_selects_the_sources_even_where_extensions_are_built():
    child = _paths_in_child({accel.PURE_ENV: "1"})
    assert child["implementation"] == "python"
    assert set(child["modules"]) == set(accel.COMPILED_MODULES)


@pytest.mark.skipif(not _built(), reason="the extensions are not built here (WHEELD_NO_EXTENSIONS)")
def test_without_the_flag_the_extensions_run():
    child = _paths_in_child({accel.PURE_ENV: "0"})
    assert child["implementation"] == "compiled", child


def test_an_in_place_build_older_than_its_source_is_not_used(tmp_path, monkeypatch):
    package = tmp_path / "hotpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "mod.py").write_text("WHERE = 'source'\n")
    (package / "mod.c").write_text("/* generated */\n")
    extension = package / ("mod" + EXTENSIONS[0])
    extension.write_bytes(b"not a real extension")
    old = os.path.getmtime(package / "mod.py") - 100
    os.utime(extension, (old, old))
    monkeypatch.setitem(accel.COMPILED_MODULES, "hotpkg.mod", "hotpkg/mod.py")
    finder = accel._PureFinder(pure=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spec = finder.find_spec("hotpkg.mod", [str(package)])
    assert spec is not None and spec.origin == str(package / "mod.py")
    assert any("older than" in str(w.message) for w in caught)
    # up to date: the finder steps aside, so the ordinary finders pick the extension
    new = os.path.getmtime(package / "mod.py") + 100
    os.utime(extension, (new, new))
    assert finder.find_spec("hotpkg.mod", [str(package)]) is None
    # asked for the Python path: the source, whatever the extension's age
    assert accel._PureFinder(pure=True).find_spec("hotpkg.mod", [str(package)]).origin == str(package / "mod.py")
    # not a hot module: never this finder's business
    assert finder.find_spec("hotpkg.other", [str(package)]) is None


def test_a_build_older_than_a_pxd_it_cimports_is_not_used(tmp_path, monkeypatch):
    """The extension's inputs are its .py, its .pxd, and the .pxd of each hot module that one
    cimports (relative or absolute), found through COMPILED_MODULES from the checkout root."""
    package = tmp_path / "hotpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("WHERE = 'source'\n")
    (package / "a.c").write_text("/* generated */\n")
    (package / "a.pxd").write_text("cimport cython\nfrom .b cimport Thing\n")
    (package / "b.py").write_text("")
    (package / "b.pxd").write_text("from hotpkg.c cimport Other\n")
    (package / "c.pxd").write_text("cdef class Other:\n    pass\n")
    extension = package / ("a" + EXTENSIONS[0])
    extension.write_bytes(b"not a real extension")
    for name in ("hotpkg.a", "hotpkg.b", "hotpkg.c"):
        monkeypatch.setitem(accel.COMPILED_MODULES, name, f"hotpkg/{name[7:]}.py")
    base = os.path.getmtime(package / "a.py")
    for leaf in ("a.py", "a.pxd", "b.pxd", "c.pxd"):
        os.utime(package / leaf, (base - 100, base - 100))
    os.utime(extension, (base, base))
    finder = accel._PureFinder(pure=False)
    assert finder.find_spec("hotpkg.a", [str(package)]) is None, "up to date: the extension runs"
    os.utime(package / "c.pxd", (base + 100, base + 100))  # two cimports away
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spec = finder.find_spec("hotpkg.a", [str(package)])
    assert spec is not None and spec.origin == str(package / "a.py")
    assert any(f"older than {package / 'c.pxd'}" in str(w.message) for w in caught), [str(w.message) for w in caught]


def test_a_build_whose_cimported_module_runs_from_source_is_not_used(tmp_path, monkeypatch):
    """An extension built against another hot module's C types cannot be imported beside
    that module's Python source (Cython: "size changed"): when the module it cimports is
    stale, and so runs from source, it runs from source too, with a warning."""
    package = tmp_path / "hotpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for leaf in ("a", "b"):
        (package / f"{leaf}.py").write_text("WHERE = 'source'\n")
        (package / f"{leaf}.c").write_text("/* generated */\n")
        (package / f"{leaf}{EXTENSIONS[0]}").write_bytes(b"not a real extension")
    (package / "a.pxd").write_text("from hotpkg.b cimport Segment\n")
    (package / "b.pxd").write_text("cdef class Segment:\n    pass\n")
    for name in ("hotpkg.a", "hotpkg.b"):
        monkeypatch.setitem(accel.COMPILED_MODULES, name, f"hotpkg/{name[7:]}.py")
    base = os.path.getmtime(package / "a.py")
    for leaf in ("a.py", "a.pxd", "b.py", "b.pxd"):
        os.utime(package / leaf, (base - 100, base - 100))
    for leaf in ("a", "b"):
        os.utime(package / f"{leaf}{EXTENSIONS[0]}", (base, base))
    finder = accel._PureFinder(pure=False)
    assert finder.find_spec("hotpkg.a", [str(package)]) is None, "both up to date: the extension runs"
    os.utime(package / "b.py", (base + 100, base + 100))  # b edited, not rebuilt: b runs from source
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spec = finder.find_spec("hotpkg.a", [str(package)])
    assert spec is not None and spec.origin == str(package / "a.py")
    assert any(f"older than {package / 'b.py'}" in str(w.message) for w in caught), [str(w.message) for w in caught]
    os.utime(package / f"b{EXTENSIONS[0]}", (base + 200, base + 200))  # b rebuilt (a needs no rebuild)
    assert finder.find_spec("hotpkg.a", [str(package)]) is None


def test_the_inputs_of_the_shipped_hot_modules_include_what_their_pxd_cimports():
    inputs = accel._build_inputs(str(ROOT / "daemon" / "executor.py"), "wheeld.daemon.executor")
    relative = {os.path.relpath(path, ROOT) for path in inputs}
    assert {"daemon/executor.py", "daemon/executor.pxd", "shm/wheel.pxd", "shm/keyindex.pxd",
            "protocol/keycodec.pxd"} <= relative
    # the key decoder both the wheel and the client core compile in (no module of its own)
    for module in ("wheeld.shm.wheel", "wheeld.core"):
        inputs = accel._build_inputs(str(ROOT / accel.COMPILED_MODULES[module]), module)
        assert str(ROOT / "protocol" / "keycodec.pxd") in inputs, (module, inputs)


def test_a_build_older_than_a_c_only_pxd_it_cimports_is_not_used(tmp_path, monkeypatch):
    """A .pxd of PXD_ONLY (inline C, no module of its own) is an input of every extension
    whose .pxd cimports it: edited after the build, the source runs, with a warning."""
    package = tmp_path / "hotpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("WHERE = 'source'\n")
    (package / "a.c").write_text("/* generated */\n")
    (package / "a.pxd").write_text("from hotpkg.codec cimport decode\n")
    (package / "codec.pxd").write_text("cdef inline int decode(int x):\n    return x\n")
    extension = package / ("a" + EXTENSIONS[0])
    extension.write_bytes(b"not a real extension")
    monkeypatch.setitem(accel.COMPILED_MODULES, "hotpkg.a", "hotpkg/a.py")
    monkeypatch.setitem(accel.PXD_ONLY, "hotpkg.codec", "hotpkg/codec.pxd")
    base = os.path.getmtime(package / "a.py")
    for leaf in ("a.py", "a.pxd", "codec.pxd"):
        os.utime(package / leaf, (base - 100, base - 100))
    os.utime(extension, (base, base))
    finder = accel._PureFinder(pure=False)
    assert finder.find_spec("hotpkg.a", [str(package)]) is None, "up to date: the extension runs"
    os.utime(package / "codec.pxd", (base + 100, base + 100))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spec = finder.find_spec("hotpkg.a", [str(package)])
    assert spec is not None and spec.origin == str(package / "a.py")
    messages = [str(w.message) for w in caught]
    assert any(f"older than {package / 'codec.pxd'}" in message for message in messages), messages


def _source_copy(into: Path) -> Path:
    tree = into / "src"
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for name in tracked:
        if (name.startswith(("tests/", "bench/", "docs/", "examples/", "pipeline/"))
                and not name.endswith("__init__.py")):
            continue
        target = tree / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target)
    return tree


def _pip_wheel(tree: Path, out: Path, env_extra: dict) -> subprocess.CompletedProcess:
    env = dict(os.environ, **env_extra, PIP_NO_INDEX="1")
    return subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(tree)],
        env=env, capture_output=True, text=True, timeout=600,
    )


def test_no_extensions_at_install_builds_a_pure_package(tmp_path):
    pytest.importorskip("Cython")
    tree = _source_copy(tmp_path)
    result = _pip_wheel(tree, tmp_path / "out", {accel.NO_EXTENSIONS_ENV: "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    (wheel,) = (tmp_path / "out").glob("wheeld-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "wheeld/shm/wheel.py" in names
    assert not [n for n in names if n.endswith(".so")], names


def test_a_build_error_fails_the_install(tmp_path):
    pytest.importorskip("Cython")
    tree = _source_copy(tmp_path)
    (tree / "shm" / "placement.pxd").write_text("cdef class Placement:\n    cdef this is not Cython\n")
    result = _pip_wheel(tree, tmp_path / "out", {})
    assert result.returncode != 0
    assert "placement.pxd" in result.stdout + result.stderr
    assert not list((tmp_path / "out").glob("*.whl")) if (tmp_path / "out").exists() else True


@pytest.mark.parametrize("pure", [False, True], ids=["default", "WHEELD_PURE_PYTHON=1"])
def test_the_daemon_says_which_path_runs(tmp_path, pure):
    if not pure and not _built():
        pytest.skip("the extensions are not built here (WHEELD_NO_EXTENSIONS)")
    expected = "python" if pure else "compiled"
    daemon = DaemonProcess(tmp_path, capacity=1000)
    try:
        daemon.start(env={accel.PURE_ENV: "1" if pure else "0"})
        assert f"{expected} hot path" in daemon.log()
        assert daemon.counters()["daemon_hot_path"] == accel.PATH_CODES[expected]
        runner = CliRunner()
        base = ["--name", daemon.name, "--socket", daemon.socket_path, "stats", "--interval", "0"]
        table = runner.invoke(wheelctl_main, base)
        assert f"hot path {expected}" in table.output, table.output
        as_json = json.loads(runner.invoke(wheelctl_main, [*base, "--json"]).output)
        assert as_json["daemon"]["hot_path"] == expected
        text = runner.invoke(wheelctl_main, [*base, "--prometheus"]).output
        assert f'wheeld_build_info{{hot_path="{expected}"}} 1' in text.splitlines()
    finally:
        daemon.cleanup()
