"""The engine and the job steps read top-down: no function in src/kvlab/engine or src/kvlab/steps is over 60 lines
(its docstring included) or takes over 8 parameters (self and cls aside)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES, MAX_PARAMS = 60, 8


def sizes(path: Path) -> dict[str, tuple[int, int]]:
    """Each function of a module (methods and nested ones too, by their own name): its lines and its parameters."""
    out = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg))]
            if params and params[0].arg in ("self", "cls"):
                params = params[1:]
            out[node.name] = (node.end_lineno - node.lineno + 1, len(params))
    return out


def oversized() -> dict[tuple[str, str], tuple[int, int]]:
    src = ROOT / "src" / "kvlab"
    return {(str(p.relative_to(src)), name): size for folder in ("engine", "steps") for p in sorted((src / folder).glob("*.py"))
            for name, size in sizes(p).items() if size[0] > MAX_LINES or size[1] > MAX_PARAMS}


def test_counts_what_it_says(tmp_path):
    text = "def f(a, b, *c, d, **e):\n" + "    x = 1\n" * 70 + "class K:\n    def g(self, a):\n        pass\n"
    (tmp_path / "probe.py").write_text(text)
    assert sizes(tmp_path / "probe.py") == {"f": (71, 5), "g": (2, 1)}


def test_no_function_in_the_engine_or_the_steps_is_over_60_lines_or_8_parameters():
    assert oversized() == {}  # (module, function) -> (lines, parameters) of each one to split
