"""Lint as CI sees it (unmarked: seconds, so `make test-fast` runs it too): Snakemake's own lint, ruff, snakefmt."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_lint_is_clean():
    proc = subprocess.run([sys.executable, "-m", "snakemake", "--lint"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_python_lint_is_clean():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "src", "kernels", "tests", "workflow"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_rules_are_snakefmt_formatted():
    """snakefmt, with [tool.snakefmt] from pyproject.toml (the line length ruff uses), would change nothing in the rules."""
    proc = subprocess.run([sys.executable, "-m", "snakefmt", "--check", "Snakefile", "rules"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
