# Two commands for a newcomer on a fresh machine:
#   make run    install (once) what the daemon needs into .venv and start wheeld in the foreground
#   make test   install (once) the test, bench and pipeline extras too, and run the test suite
# Both compile the hot path (Cython, gcc and the Python headers) first: `make build`.
# WHEELD_NO_EXTENSIONS=1 builds no extension (the Python path); WHEELD_PURE_PYTHON=1 runs
# the Python path even where the extensions are built.
# PYTHON and VENV choose the interpreter and the venv: `make test-core PYTHON=python3.13
# VENV=.venv-3.13` runs the core tests on another Python the project supports (.ci/run does).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
HASH   := $(shell cat pyproject.toml | cksum | cut -d' ' -f1)
BUILD_STAMP := $(VENV)/.installed-build-$(HASH)
RUN_STAMP   := $(VENV)/.installed-run-$(HASH)
CORE_STAMP  := $(VENV)/.installed-core-$(HASH)
TEST_STAMP  := $(VENV)/.installed-test-$(HASH)

.PHONY: install build-requirements build run test test-fast test-core test-pure test-long lint bench clean simulate fleet-demo

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# The installs below build without isolation, in the venv itself, so the venv must hold
# pyproject.toml's [build-system] requires (setuptools, Cython) whoever made it: a venv
# made by hand (python3 -m venv .venv && .venv/bin/pip install -e .) has none of them.
$(BUILD_STAMP): pyproject.toml | $(VENV)/bin/python
	$(BIN)/python -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"], sep="\n")' > $(VENV)/build-requirements.txt
	$(BIN)/python -m pip install -q --upgrade pip -r $(VENV)/build-requirements.txt
	rm -f $(VENV)/.installed-build-*; touch $@

build-requirements: $(BUILD_STAMP)

# The editable installs below compile nothing (WHEELD_NO_EXTENSIONS=1): `make build` compiles
# the extensions once, in place, where the editable install finds them.

# what running the daemon needs, nothing more
$(RUN_STAMP): pyproject.toml | $(BUILD_STAMP)
	WHEELD_NO_EXTENSIONS=1 $(BIN)/python -m pip install -q --no-build-isolation -e .
	rm -f $(VENV)/.installed-run-*; touch $@

# the core tests (make test-core) need the test extra
$(CORE_STAMP): pyproject.toml | $(BUILD_STAMP)
	WHEELD_NO_EXTENSIONS=1 $(BIN)/python -m pip install -q --no-build-isolation -e '.[test]'
	rm -f $(VENV)/.installed-core-* $(VENV)/.installed-run-*; touch $@ $(RUN_STAMP)

# the suite also needs the test, bench and pipeline extras (PySpark is the big one)
$(TEST_STAMP): pyproject.toml | $(BUILD_STAMP)
	WHEELD_NO_EXTENSIONS=1 $(BIN)/python -m pip install -q --no-build-isolation -e '.[test,bench,pipeline]'
	rm -f $(VENV)/.installed-test-* $(VENV)/.installed-core-* $(VENV)/.installed-run-*; touch $@ $(CORE_STAMP) $(RUN_STAMP)

# the fleet tier (NATS JetStream): nats-py and the nats-server binary, for make fleet-demo
FLEET_STAMP := $(VENV)/.installed-fleet-$(HASH)
$(FLEET_STAMP): pyproject.toml | $(BUILD_STAMP)
	WHEELD_NO_EXTENSIONS=1 $(BIN)/python -m pip install -q --no-build-isolation -e '.[fleet]'
	rm -f $(VENV)/.installed-fleet-*; touch $@

# a 3-node NATS cluster and two wheeld hosts on this machine; one is lost, the other
# delivers its timers (docs/fleet.md)
fleet-demo: $(FLEET_STAMP) build
	$(BIN)/python examples/fleet_demo.py

install: build

# the extensions, compiled in place beside their sources (only what changed is rebuilt)
build: $(RUN_STAMP)
	$(BIN)/python setup.py -q build_ext --inplace

run: build
	$(BIN)/wheeld

test: $(TEST_STAMP) build
	$(BIN)/python -m pytest -n 4 -q
	$(MAKE) --no-print-directory test-pure

# the core, ring, client, purgatory and daemon modules again on the Python path (the reference)
PURE_TESTS := tests/test_wheel_unit.py tests/test_wheel_model.py tests/test_wheel_crash.py tests/test_keyindex.py \
	tests/test_placement.py tests/test_ring.py tests/test_ring_multiprocess.py tests/test_client_misuse.py \
	tests/test_cancel_contract.py tests/test_planner.py tests/test_delivery.py tests/test_e2e.py \
	tests/test_hostile.py tests/test_fuzz_daemon.py tests/test_never_early.py tests/test_daemon_clock.py tests/test_accel.py \
	tests/test_purgatory.py tests/test_hostile_values.py tests/test_arena_damage.py tests/test_simulation.py \
	tests/test_frames.py
test-pure: $(TEST_STAMP)
	WHEELD_PURE_PYTHON=1 $(BIN)/python -m pytest -n 4 -q $(PURE_TESTS)

# the core tests on one interpreter (PYTHON, VENV): compiled, then on the Python path (the
# reference), and the differential tests that hold the two (and each C twin) to the same answers; only the
# test extra is installed. .ci/run runs it on every Python the project claims besides the
# one `make test` runs on.
CORE_TESTS := $(PURE_TESTS) tests/test_compiled_differential.py tests/test_c_twins.py tests/test_corrupt_arena_fuzz.py \
	tests/test_build_flags.py
test-core: $(CORE_STAMP) build
	$(BIN)/python -c 'import sys; print("make test-core:", sys.executable, sys.version.split()[0])'
	$(BIN)/python -m pytest -n 4 -q $(CORE_TESTS)
	WHEELD_PURE_PYTHON=1 $(BIN)/python -m pytest -n 4 -q $(PURE_TESTS)

# the edit-test loop: the tests that start no process and need no PySpark (markers
# `process` and `spark`, set by tests/conftest.py), with smaller random slices (fresh
# simulation seeds for 5 s, 50 journal seeds per case, 30 model examples, a kill at
# every third line of the arena's crash sweep, 60 random-kill rounds); `make test`
# still runs everything, at full size
FAST_SLICES := WHEELD_SIM_SLICE_S=5 WHEELD_SIM_SEEDS=50 WHEELD_MODEL_EXAMPLES=30 \
	WHEELD_CRASH_STRIDE=3 WHEELD_CRASH_ROUNDS=60
test-fast: $(CORE_STAMP) build
	$(FAST_SLICES) $(BIN)/python -m pytest -n 4 -q -m "not slow and not spark and not process"

# the long chaos/scale/fuzz variants (marked slow), which `make test` leaves out
test-long: $(TEST_STAMP) build
	$(BIN)/python -m pytest -n 4 -q -m slow

# ruff over the tree, mypy over wheeld.protocol, wheeld.journal and the client's public modules
# (.ci/typecheck.py), the import contracts of pyproject.toml ([tool.importlinter]):
# which layer may import which, and the size limits (.ci/sizes.py: functions <= 60
# lines, classes <= 600). Their settings: pyproject's [tool.ruff] and [tool.mypy].
lint: $(TEST_STAMP)
	$(BIN)/ruff check .
	$(BIN)/python .ci/typecheck.py
	$(BIN)/python .ci/lint_imports.py
	$(BIN)/python .ci/sizes.py

# the deterministic simulation (tests/sim, docs/testing.md): SEEDS fresh seeds on every core,
# or one seed replayed with its trace (SEED=N [OPS=N]); a failing seed prints its replay command
SEEDS ?= 1000
OPS   ?= 1000
simulate: $(TEST_STAMP) build
ifdef SEED
	cd tests && ../$(BIN)/python -m sim --seed $(SEED) --ops $(OPS) --trace --shrink
else
	cd tests && ../$(BIN)/python -m sim --seeds $(SEEDS) --ops $(OPS)
endif

bench: $(TEST_STAMP) build
	$(BIN)/python -m bench.wheel_core

clean:
	rm -rf $(VENV) build *.egg-info
	rm -f shm/*.so shm/*.c client/*.so client/*.c daemon/*.so daemon/*.c protocol/*.so protocol/*.c
