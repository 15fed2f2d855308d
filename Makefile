# Two commands for a newcomer on a fresh machine:
#   make run    install (once) into .venv and start wheeld in the foreground with defaults
#   make test   install (once) and run the test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: install run test test-long bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,bench,pipeline]'
	rm -f $(VENV)/.installed-*; touch $@

install: $(STAMP)

run: $(STAMP)
	$(BIN)/wheeld

test: $(STAMP)
	$(BIN)/python -m pytest -n auto -q

test-long: $(STAMP)
	WHEELD_LONG=1 $(BIN)/python -m pytest -n auto -q -m slow

bench: $(STAMP)
	$(BIN)/python -m bench.wheel_core

clean:
	rm -rf $(VENV) build *.egg-info
