"""A hot module loaded from its ``.py`` source, whichever path the process runs.

``sys.settrace`` sees no line of a compiled module, so the crash tests that kill
a writer between two given lines of ``shm/wheel.py`` run that file's source,
loaded here under another module name (``wheeld.shm._source_wheel``): its
relative imports resolve in the same package as the compiled module's would.
The tests that kill at random instants run whatever path the process selected
(compiled unless ``WHEELD_PURE_PYTHON=1``).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from types import ModuleType


def load(name: str) -> ModuleType:
    """``name`` (e.g. ``wheeld.shm.wheel``) executed from its ``.py`` file, as a module of its own."""
    package, _, leaf = name.rpartition(".")
    alias = f"{package}._source_{leaf}"
    if alias in sys.modules:
        return sys.modules[alias]
    parent = importlib.import_module(package)
    for directory in parent.__path__:
        source = os.path.join(directory, leaf + ".py")
        if os.path.exists(source):
            spec = importlib.util.spec_from_file_location(alias, source)
            module = importlib.util.module_from_spec(spec)
            sys.modules[alias] = module
            spec.loader.exec_module(module)
            return module
    raise ImportError(f"no source file for {name}")
