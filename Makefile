# Two commands for a newcomer on a fresh machine:
#   make run    install (once) what the daemon needs into .venv and start wheeld in the foreground
#   make test   install (once) the test, bench and pipeline extras too, and run the test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
HASH   := $(shell cat pyproject.toml | cksum | cut -d' ' -f1)
RUN_STAMP  := $(VENV)/.installed-run-$(HASH)
TEST_STAMP := $(VENV)/.installed-test-$(HASH)

.PHONY: install run test test-long lint bench clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# what running the daemon needs, nothing more
$(RUN_STAMP): pyproject.toml | $(VENV)/bin/python
	$(BIN)/python -m pip install -q -e .
	rm -f $(VENV)/.installed-run-*; touch $@

# the suite also needs the test, bench and pipeline extras (PySpark is the big one)
$(TEST_STAMP): pyproject.toml | $(VENV)/bin/python
	$(BIN)/python -m pip install -q -e '.[test,bench,pipeline]'
	rm -f $(VENV)/.installed-test-* $(VENV)/.installed-run-*; touch $@ $(RUN_STAMP)

install: $(RUN_STAMP)

run: $(RUN_STAMP)
	$(BIN)/wheeld

test: $(TEST_STAMP)
	$(BIN)/python -m pytest -n 4 -q

# the long chaos/scale/fuzz variants (marked slow), which `make test` leaves out
test-long: $(TEST_STAMP)
	$(BIN)/python -m pytest -n 4 -q -m slow

# the import contracts of pyproject.toml ([tool.importlinter]): which layer may import which
lint: $(TEST_STAMP)
	$(BIN)/python .ci/lint_imports.py

bench: $(TEST_STAMP)
	$(BIN)/python -m bench.wheel_core

clean:
	rm -rf $(VENV) build *.egg-info
