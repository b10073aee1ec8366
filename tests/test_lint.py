"""Lint as CI sees it (unmarked: seconds, so `make test-fast` runs it too): Snakemake's own lint, ruff, snakefmt,
and the floors of the code (import-linter's contract in pyproject.toml; kvlab.kernels checked here)."""

import ast
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


def test_imports_keep_their_floors():
    """No module imports from a floor above its own (tools > steps > run state > engine and report > method and task
    kinds > models and statistics > helpers), nor, within tools, steps and state, from a module above its own: the
    engine calls the kinds, and a kind never imports the engine. import-linter reads the contracts from pyproject.toml."""
    proc = subprocess.run([str(Path(sys.executable).with_name("lint-imports"))], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "4 kept, 0 broken" in proc.stdout


def test_kernels_import_nothing_of_kvlab_but_themselves():
    """kvlab.kernels (the kernels/ folder, outside the folder import-linter walks) is the bottom floor."""
    for path in sorted((ROOT / "kernels").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else (
                [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for name in names:
                assert not name.startswith("kvlab") or name.startswith("kvlab.kernels"), f"{path.name} imports {name}"
