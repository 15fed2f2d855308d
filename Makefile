# Two commands for a newcomer on a fresh machine:
#   make run    install (once) what the daemon needs into .venv and start wheeld in the foreground
#   make test   install (once) the test, bench and pipeline extras too, and run the test suite
# Both compile the hot path (Cython, gcc and the Python headers) first: `make build`.
# WHEELD_NO_EXTENSIONS=1 builds no extension (the Python path); WHEELD_PURE_PYTHON=1 runs
# the Python path even where the extensions are built.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
HASH   := $(shell cat pyproject.toml | cksum | cut -d' ' -f1)
RUN_STAMP  := $(VENV)/.installed-run-$(HASH)
TEST_STAMP := $(VENV)/.installed-test-$(HASH)

.PHONY: install build run test test-pure test-long lint bench clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip "setuptools>=77" "Cython>=3.0"

# what running the daemon needs, nothing more
$(RUN_STAMP): pyproject.toml | $(VENV)/bin/python
	$(BIN)/python -m pip install -q --no-build-isolation -e .
	rm -f $(VENV)/.installed-run-*; touch $@

# the suite also needs the test, bench and pipeline extras (PySpark is the big one)
$(TEST_STAMP): pyproject.toml | $(VENV)/bin/python
	$(BIN)/python -m pip install -q --no-build-isolation -e '.[test,bench,pipeline]'
	rm -f $(VENV)/.installed-test-* $(VENV)/.installed-run-*; touch $@ $(RUN_STAMP)

install: $(RUN_STAMP)

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
	tests/test_purgatory.py tests/test_hostile_values.py tests/test_arena_damage.py
test-pure: $(TEST_STAMP)
	WHEELD_PURE_PYTHON=1 $(BIN)/python -m pytest -n 4 -q $(PURE_TESTS)

# the long chaos/scale/fuzz variants (marked slow), which `make test` leaves out
test-long: $(TEST_STAMP) build
	$(BIN)/python -m pytest -n 4 -q -m slow

# the import contracts of pyproject.toml ([tool.importlinter]): which layer may import which
lint: $(TEST_STAMP)
	$(BIN)/python .ci/lint_imports.py

bench: $(TEST_STAMP) build
	$(BIN)/python -m bench.wheel_core

clean:
	rm -rf $(VENV) build *.egg-info
	rm -f shm/*.so shm/*.c client/*.so client/*.c daemon/*.so daemon/*.c protocol/*.so protocol/*.c
