"""The compiled build refuses a call of a C function that no header declares.

C takes an undeclared function's result for an ``int``: a 64-bit value (a hash) comes
back with half its bits, and the build only warns. That is how a Python release that
stopped declaring a function in ``Python.h`` (``_Py_HashBytes`` in 3.13) gave the key
index wrong hashes. setup.py compiles with ``COMPILE_ARGS``; this compiles a small C
file with them, the way it compiles the extensions.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CC = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
pytestmark = pytest.mark.skipif(CC is None, reason="needs a C compiler (the compiled build does too)")


def compile_args() -> list[str]:
    """setup.py's COMPILE_ARGS (read, not run: running setup.py builds)."""
    for node in ast.parse((ROOT / "setup.py").read_text()).body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["COMPILE_ARGS"]:
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no COMPILE_ARGS")


def compile_c(tmp_path: Path, source: str) -> subprocess.CompletedProcess:
    path = tmp_path / "probe.c"
    path.write_text(source)
    return subprocess.run([CC, *compile_args(), "-I", sysconfig.get_paths()["include"], "-c", str(path),
                           "-o", str(tmp_path / "probe.o")], capture_output=True, text=True, timeout=120)


BODY = """
long long probe(const void *p, Py_ssize_t n) {
    return wheeld_probe_hash(p, n) ^ 1;
}
"""


def test_a_call_of_an_undeclared_function_fails_the_build(tmp_path):
    refused = compile_c(tmp_path, "#include <Python.h>\n" + BODY)
    assert refused.returncode != 0, "an undeclared function compiled (its result would be taken for an int)"
    assert "wheeld_probe_hash" in refused.stderr
    declared = compile_c(tmp_path, "#include <Python.h>\n"
                                   "Py_hash_t wheeld_probe_hash(const void *, Py_ssize_t);\n" + BODY)
    assert declared.returncode == 0, declared.stderr
