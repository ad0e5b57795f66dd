# Two commands a newcomer needs: `make demo` (the main job) and `make test` (the whole suite).
# Both set up .venv first: the pinned CPU build of torch, then the project with its extras.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
TORCH_VERSION ?= 2.13.0

.PHONY: install demo test sample-data dashboard bench clean

$(STAMP): pyproject.toml setup.py mismatch_monitor/engine/_native.c
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build
	$(PY) -m pip install --quiet "torch==$(TORCH_VERSION)"
	$(PY) -m pip install --quiet -e ".[test,trl]"
	touch $(STAMP)

install: $(STAMP)

# a live simulated run while the dashboard follows it; Ctrl-C stops the dashboard at the end
demo: install
	$(VENV)/bin/mismatch-monitor demo --dashboard $(DEMO_ARGS)

test: install
	$(PY) -m pytest $(PYTEST_ARGS) || { status=$$?; echo "make test: pytest exited with status $$status" \
		"(1 tests failed, 2 interrupted, 3 internal error, 4 usage error, 5 no tests collected)" >&2; exit $$status; }

sample-data: install
	$(VENV)/bin/mismatch-monitor sample-data

dashboard: install
	$(VENV)/bin/mismatch-monitor dashboard sample_data

bench: install
	$(PY) benchmarks/bench_engine.py --sizes 100k,1M --routing-tokens 200k
	$(PY) benchmarks/bench_collector.py
	$(PY) benchmarks/bench_sim.py

clean:
	rm -rf $(VENV) artifacts .pytest_cache
