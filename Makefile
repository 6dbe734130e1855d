# Quick start: `make demo` runs the demo, `make test` runs the tests. Both set up
# .venv first (the package, its test extras, and torch 2.13.0 when the venv has none).
# `make test` also sets up .venv-msprobe with the real msprobe (mindstudio-probe), in
# its own venv, for the tests that check our exports against it (about a minute more,
# the first time). `make demo` writes its run under probe_runs/ (git-ignored). The graphviz and
# browser tests skip without graphviz and Chromium: `make system-deps` installs them
# (Debian packages; CI does this and sets PROBE_REQUIRE_TOOLS=1, so there they must run).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.probe-installed
MSPROBE_VENV ?= .venv-msprobe
MSPROBE_STAMP := $(MSPROBE_VENV)/.installed
# msprobe 8.3.3, the last release with free_benchmark: a peer of the performance report only.
MSPROBE_FB_VENV ?= .venv-msprobe-fb
MSPROBE_FB_STAMP := $(MSPROBE_FB_VENV)/.installed

.PHONY: demo test lint bench-quick peers system-deps clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test,viewer]"
	touch $(STAMP)

$(MSPROBE_STAMP):
	test -x $(MSPROBE_VENV)/bin/python || python3 -m venv $(MSPROBE_VENV)
	$(MSPROBE_VENV)/bin/python -c "import torch" 2>/dev/null || $(MSPROBE_VENV)/bin/python -m pip install -q torch==2.13.0
	$(MSPROBE_VENV)/bin/python -m pip install -q "mindstudio-probe>=26,<27" rich safetensors
	touch $(MSPROBE_STAMP)

$(MSPROBE_FB_STAMP):
	test -x $(MSPROBE_FB_VENV)/bin/python || python3 -m venv $(MSPROBE_FB_VENV)
	$(MSPROBE_FB_VENV)/bin/python -c "import torch" 2>/dev/null || $(MSPROBE_FB_VENV)/bin/python -m pip install -q torch==2.13.0
	$(MSPROBE_FB_VENV)/bin/python -m pip install -q "mindstudio-probe==8.3.3" rich safetensors networkx
	touch $(MSPROBE_FB_STAMP)

# The performance report's peers (benchmarks/report.py): msprobe 26.x and 8.3.3.
peers: $(MSPROBE_STAMP) $(MSPROBE_FB_STAMP)

demo: $(STAMP)
	$(VENV)/bin/probe demo

test: $(STAMP) $(MSPROBE_STAMP)
	PROBE_MSPROBE=$(MSPROBE_VENV)/bin/msprobe $(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check probe tests benchmarks

bench-quick: $(STAMP)
	$(PY) -m benchmarks.overhead --quick
	$(PY) -m benchmarks.gc_pressure --quick
	$(PY) -m benchmarks.dump_throughput --quick
	$(PY) -m benchmarks.free_benchmark --quick
	$(PY) -m benchmarks.graph_export --quick
	$(PY) -m benchmarks.monitor --quick
	$(PY) -m benchmarks.cost_model --quick
	$(PY) -m benchmarks.report --quick
	$(PY) -m benchmarks.diagnosis --quick --check
	$(PY) -m benchmarks.zoo --quick --check

system-deps:
	command -v dot >/dev/null && test -x /usr/bin/chromium && test -x /usr/bin/chromedriver || { \
	  SUDO=$$(test "$$(id -u)" = 0 || echo sudo); \
	  $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive \
	  $$SUDO apt-get install -y -q --no-install-recommends graphviz chromium chromium-driver; }

clean:
	rm -rf $(VENV) $(MSPROBE_VENV) $(MSPROBE_FB_VENV) probe_runs
