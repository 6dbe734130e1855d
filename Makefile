# Quick start: `make demo` runs the demo, `make test` runs the tests. Both set up
# .venv first (the package, its test extras, and torch 2.13.0 when the venv has none).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.probe-installed

.PHONY: demo test lint bench-quick clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/probe demo

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check probe tests benchmarks

bench-quick: $(STAMP)
	$(PY) -m benchmarks.overhead --quick

clean:
	rm -rf $(VENV) probe_runs
