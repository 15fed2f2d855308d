"""What a client's import loads: the client library and its ring, not the daemon's wheel.

``import wheeld; wheeld.connect`` reaches ``wheeld.shm`` (the ring and the status
page live there); the package loads its wheel names on first use (PEP 562), so a
worker process does not load the wheel, its key index, placement rule, checker or
the daemon. numpy still comes with the ring (its records are a numpy view, and
``protocol.commands`` defines their dtype).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

NOT_FOR_CLIENTS = ("wheeld.shm.wheel", "wheeld.shm.keyindex", "wheeld.shm.placement", "wheeld.shm.fsck",
                   "wheeld.shm.arena", "wheeld.daemon", "wheeld.pipeline", "pyspark", "posix_ipc",
                   "wheeld.fleet", "nats")


def _loaded(code: str, pure: bool) -> list[str]:
    env_code = ("import os; os.environ['WHEELD_PURE_PYTHON'] = '1'; " if pure else "") + code
    out = subprocess.run([sys.executable, "-c",
                          env_code + "; import sys, json; print(json.dumps(sorted(sys.modules)))"],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    return json.loads(out.splitlines()[-1])


@pytest.mark.parametrize("pure", [False, True], ids=["compiled", "python"])
@pytest.mark.parametrize("code", ["import wheeld; wheeld.connect", "import wheeld; wheeld.connect_async",
                                  "import wheeld; wheeld.Expired"])
def test_a_client_import_loads_no_wheel_and_no_daemon(code, pure):
    loaded = _loaded(code, pure)
    assert "wheeld.shm.ring" in loaded or "wheeld.core" in loaded, "the import under test loaded the client"
    unwanted = [m for m in loaded if m.startswith(NOT_FOR_CLIENTS)]
    assert not unwanted, f"{code!r} loads {unwanted}"


def test_the_wheel_names_still_come_from_the_package():
    loaded = _loaded("from wheeld.shm import TimerWheel, MAX_DELAY_MS, DEFAULT_WHEEL_SIZE, encode_ident", False)
    assert "wheeld.shm.wheel" in loaded
