# Set-up and everyday commands. `make demo` and `make test` work on a fresh machine.
# On a machine without a CUDA GPU the CPU build of torch is installed first (TORCH_CPU_SPEC), so that the plain
# `torch` requirement never pulls a multi-GB CUDA build. Override TORCH_CPU_SPEC / TORCH_PIP_ARGS where needed
# (e.g. TORCH_PIP_ARGS="--index-url <your CPU wheel index>").
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_CPU_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=

.PHONY: demo test lint format setup setup-dev bench clean browser cluster-tools

$(VENV)/.torch:
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch, sys; sys.exit(0 if tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]) >= (2, 6) else 1)" 2>/dev/null \
	  || { if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	         echo "CUDA GPU found: installing torch with CUDA"; $(PIP) install -q "torch>=2.6" $(TORCH_PIP_ARGS); \
	       else \
	         echo "no CUDA GPU: installing the CPU build ($(TORCH_CPU_SPEC))"; $(PIP) install -q "$(TORCH_CPU_SPEC)" $(TORCH_PIP_ARGS); \
	       fi; }
	@touch $@

$(VENV)/.installed: $(VENV)/.torch pyproject.toml
	$(PIP) install -q -e .
	@touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PIP) install -q -e ".[dev]"
	@touch $@

# The demo's set-up: the base package and the eval extra (lm-eval scores the shipped task before and after
# training); the torch already installed (the CPU build on a machine without a CUDA GPU) is pinned, so the
# resolver never swaps it.
$(VENV)/.installed-eval: $(VENV)/.installed
	$(PIP) install -q -e ".[eval]" "torch==$$($(PY) -c 'import torch; print(torch.__version__)')"
	@touch $@

setup: $(VENV)/.installed
setup-dev: $(VENV)/.installed-dev

demo: $(VENV)/.installed-eval
	$(VENV)/bin/llmtrain demo

# The report's browser test needs headless Chromium (Debian's package); without it that test is skipped.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 \
	  || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
	       && echo "installing chromium (apt) for the report's browser test" \
	       && (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null 2>&1; } \
	  || echo "chromium not installed: the browser test will be skipped"

# The launch tests (tests/test_launch_cluster.py) start Open MPI's mpirun and a one-host Slurm (slurmctld, slurmd,
# munged): Debian's openmpi-bin, slurm-wlm and munge. Without them (not root, no apt) those tests are skipped.
cluster-tools:
	@{ command -v mpirun && command -v slurmctld && command -v slurmd && command -v munged; } >/dev/null 2>&1 \
	  || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
	       && echo "installing openmpi-bin, slurm-wlm and munge (apt) for the mpirun and Slurm launch tests" \
	       && (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin slurm-wlm munge) \
	          >/dev/null 2>&1; } \
	  || echo "openmpi-bin / slurm-wlm / munge not installed (needs root and apt): the mpirun and Slurm launch tests will be skipped"

test: $(VENV)/.installed-dev browser cluster-tools
	$(PY) -m pytest -q -n 2 --dist loadfile tests --durations=10

lint: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/ruff format --check src tests bench
	$(VENV)/bin/mypy --config-file pyproject.toml

format: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check --fix src tests bench
	$(VENV)/bin/ruff format src tests bench

bench: $(VENV)/.installed-dev
	$(PY) bench/train_throughput.py

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache build src/*.egg-info
