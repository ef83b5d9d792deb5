# Two commands for a fresh machine: `make demo` (install + a speculative run on the default
# model pair, with its speed-up over plain decoding) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install demo test

$(BIN)/verispec: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

install: $(BIN)/verispec

demo: install
	$(BIN)/verispec compare

# Two worker processes (pytest-xdist): every test runs single-threaded on tiny models, so the
# suite's time halves on the 2-core machine. `pytest` alone (one process) runs the same tests.
test: install
	$(BIN)/python -m pytest -n 2
