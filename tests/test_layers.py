"""The package's layers: what importing one part loads, and the import contracts' client list.

The contracts themselves are checked by ``make lint`` (import-linter, run by .ci/run).
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _loaded_after(statement: str) -> set[str]:
    """The modules a fresh interpreter holds after ``statement``."""
    code = f"{statement}\nimport sys\nprint('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


@pytest.mark.parametrize("statement", [
    "import wheeld.protocol.journal",
    "import wheeld.journal.files, wheeld.journal.recovery",
])  # fmt: skip
def test_the_journal_format_loads_neither_the_client_nor_shared_memory(statement):
    loaded = _loaded_after(statement)
    assert not loaded & {"wheeld.core", "wheeld.sync", "wheeld.aio", "posix_ipc",
                         "numpy.core", "numpy._core"}, statement


@pytest.mark.parametrize("statement", [
    "import wheeld.daemon.server",
    "import wheeld.daemon.cli",
    "import wheeld.shm",
    "from wheeld.pipeline import generate",
])  # fmt: skip
def test_the_daemon_and_the_pipeline_do_not_load_the_client(statement):
    loaded = _loaded_after(statement)
    assert not loaded & {"wheeld.core", "wheeld.sync", "wheeld.aio", "wheeld.idle", "wheeld.purgatory"}, statement


def test_the_fleet_loads_neither_the_client_nor_the_daemon():
    """wheeld.fleet sits between the daemon and shm/journal: importing it loads neither the
    client nor the daemon, and not nats-py either (loaded when a cluster is reached)."""
    loaded = _loaded_after("import wheeld.fleet.cluster")
    assert "wheeld.fleet.cluster" in loaded
    assert not loaded & {"wheeld.core", "wheeld.sync", "wheeld.aio", "wheeld.idle", "wheeld.purgatory",
                         "wheeld.session", "wheeld.testing", "nats"}
    assert not [m for m in loaded if m.startswith(("wheeld.daemon", "wheeld.pipeline"))]


def test_the_client_api_is_there_when_used():
    import wheeld

    for name in wheeld.__all__:
        assert getattr(wheeld, name) is not None
        assert name in dir(wheeld)
    assert wheeld.connect.__module__ == "wheeld.sync" and wheeld.WheeldError.__module__ == "wheeld.protocol.errors"
    with pytest.raises(AttributeError):
        wheeld.no_such_name  # noqa: B018
    namespace: dict = {}
    exec("from wheeld import *", namespace)
    assert set(wheeld.__all__) <= set(namespace)


def test_the_contracts_name_every_client_module():
    """The import contracts list the client's modules by name (``wheeld`` is client/ and also
    the parent of the other layers): a module added to client/ must be added there too."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contracts = {c["id"]: c for c in config["tool"]["importlinter"]["contracts"]}
    client = {f"wheeld.{path.stem}" for path in (ROOT / "client").glob("*.py") if path.stem != "__init__"}
    assert set(contracts["client"]["source_modules"]) == client
    for other in ("protocol", "daemon", "pipeline"):
        assert client <= set(contracts[other]["forbidden_modules"]), other
