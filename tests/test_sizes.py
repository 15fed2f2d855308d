"""The size check of `make lint` (.ci/sizes.py) finds what it is meant to."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _sizes():
    spec = importlib.util.spec_from_file_location("ci_sizes", ROOT / ".ci" / "sizes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_long_function_and_a_large_class_are_reported(tmp_path):
    sizes = _sizes()
    (tmp_path / "daemon").mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(60))
    (tmp_path / "daemon" / "long.py").write_text(f"def long():\n{body}\n\n\ndef short():\n    return 1\n")
    methods = "\n".join(f"    def m{i}(self):\n        return {i}\n" for i in range(201))
    (tmp_path / "daemon" / "big.py").write_text(f"class Big:\n{methods}")
    found = sizes.problems(tmp_path)
    assert any("def long is 61 lines" in line for line in found), found
    assert any("class Big is 603 lines" in line for line in found), found
    assert not any("short" in line or " m1 " in line for line in found)


def test_the_tree_keeps_its_limits():
    assert _sizes().problems() == []
