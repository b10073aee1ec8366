"""What a kvpress press accepts, read from kvpress's sources without importing it (an import takes ~6 s, and
every snakemake start validates the config): its dataclass init fields (names, annotations, literal defaults,
inherited ones too) and the range checks its ``__post_init__`` asserts.

Config validation (``kvlab.state.config``) checks a method's ``kwargs`` against its press and ``wrapper_kwargs``
against its wrapper with :func:`kwargs_problem`: unknown names (with "did you mean"), values of the wrong type
for an ``int`` / ``float`` / ``bool`` / ``str`` field, and ranges. Ranges are the press's own asserts on its
fields (e.g. MergingPress ``0.0 < merge_fraction <= 1.0``, AdaKVPress ``0 <= alpha_safeguard <= 1``, LUKVPress
``sink >= 0``), evaluated on the configured values and the literal defaults, plus :data:`RANGES` for fields whose
presses assert nothing but break on such values (SnapKV / PyramidKV ``window_size`` and ``kernel_size``,
StreamingLLM ``n_sink``). tests/test_config.py checks the fields found here against ``dataclasses.fields``.
"""

from __future__ import annotations

import ast
import difflib
import functools
import importlib.util
import operator
from dataclasses import dataclass
from pathlib import Path

NO_DEFAULT = object()
SET_BY_KVLAB = {"compression_ratio", "press"}  # compression_ratio from `budgets`; a wrapper's `press` is `press`
# Fields no kvpress assert covers whose values a press cannot use: (lowest allowed, inclusive).
RANGES = {"n_sink": (0, True), "window_size": (0, False), "kernel_size": (0, False), "n_last": (0, False)}
_TYPES = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,)}
_OPS = {ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge, ast.Eq: operator.eq,
        ast.NotEq: operator.ne}


@dataclass(frozen=True)
class Field:
    annotation: str
    default: object  # a literal, or NO_DEFAULT (none, or not a literal)


@functools.cache
def _classes() -> dict[str, ast.ClassDef]:
    spec = importlib.util.find_spec("kvpress")
    out = {}
    for source in sorted(Path(spec.origin).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.ClassDef):
                out.setdefault(node.name, node)
    return out


def _base_names(node: ast.ClassDef) -> list[str]:
    return [b.id if isinstance(b, ast.Name) else getattr(b, "attr", None) for b in node.bases]


def _literal(node: ast.expr | None) -> object:
    try:
        return NO_DEFAULT if node is None else ast.literal_eval(node)
    except ValueError:
        return NO_DEFAULT


@functools.cache
def init_fields(press: str) -> dict[str, Field]:
    """The press's dataclass ``__init__`` parameters (inherited first, then its own; ``field(init=False)`` and
    ``ClassVar`` left out)."""
    classes = _classes()
    node = classes[press]
    fields: dict[str, Field] = {}
    hidden: set[str] = set()
    for base in reversed(_base_names(node)):
        if base in classes:
            fields.update(init_fields(base))
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        name, annotation = stmt.target.id, ast.unparse(stmt.annotation)
        if annotation.startswith(("ClassVar", "typing.ClassVar")):
            continue
        default = stmt.value
        if isinstance(default, ast.Call) and getattr(default.func, "id", getattr(default.func, "attr", None)) == "field":
            kw = {k.arg: k.value for k in default.keywords}
            if isinstance(kw.get("init"), ast.Constant) and kw["init"].value is False:
                hidden.add(name)
                fields.pop(name, None)
                continue
            default = kw.get("default")
        fields[name] = Field(annotation, _literal(default))
    return {n: f for n, f in fields.items() if n not in hidden}


def _post_init_asserts(press: str) -> list[ast.expr]:
    """The assert tests that run when the press is built: its own ``__post_init__``'s (and its bases' where it
    calls ``super().__post_init__()``), or its bases' when it defines none."""
    classes = _classes()
    node = classes[press]
    own = next((s for s in node.body if isinstance(s, ast.FunctionDef) and s.name == "__post_init__"), None)
    inherited = [t for b in _base_names(node) if b in classes for t in _post_init_asserts(b)]
    if own is None:
        return inherited
    tests = [s.test for s in ast.walk(own) if isinstance(s, ast.Assert)]
    calls_super = any(isinstance(c, ast.Call) and getattr(c.func, "attr", None) == "__post_init__" for c in ast.walk(own))
    return tests + (inherited if calls_super else [])


class _Unknown(Exception):
    """An assert that is not a pure comparison of fields and constants (isinstance, calls, …): not evaluated."""


def _eval(node: ast.expr, values: dict) -> object:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        if node.attr not in values:
            raise _Unknown
        return values[node.attr]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub)):
        v = _eval(node.operand, values)
        return (not v) if isinstance(node.op, ast.Not) else -v
    if isinstance(node, ast.BoolOp):
        parts = [_eval(v, values) for v in node.values]
        return all(parts) if isinstance(node.op, ast.And) else any(parts)
    if isinstance(node, ast.Compare) and all(type(op) in _OPS for op in node.ops):
        left = _eval(node.left, values)
        for op, right_node in zip(node.ops, node.comparators):
            right = _eval(right_node, values)
            if not _OPS[type(op)](left, right):
                return False
            left = right
        return True
    raise _Unknown


def _fields_in(node: ast.expr) -> set[str]:
    return {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute) and getattr(n.value, "id", None) == "self"}


def _type_ok(value: object, annotation: str) -> bool:
    allowed = _TYPES.get(annotation)
    if allowed is None:
        return True  # Optional[...], unions, tensors, …: not checked
    if isinstance(value, bool) and bool not in allowed:
        return False
    return isinstance(value, allowed)


def kwargs_problem(press: str, kwargs: dict, skip_values: tuple = ()) -> tuple[str, str] | None:
    """(the kwarg at fault, what is wrong and what would be right) for the first problem of `kwargs` given to
    `press`, or None. Values in `skip_values` (e.g. 'calibrated', filled in later) are not type- or range-checked."""
    fields = init_fields(press)
    settable = {n: f for n, f in fields.items() if n not in SET_BY_KVLAB}
    for key in kwargs:
        if key not in fields:
            close = difflib.get_close_matches(key, list(settable), n=3, cutoff=0.6)
            hint = (f"did you mean {', '.join(close)}?" if close
                    else f"{press} takes: {', '.join(sorted(settable))}" if settable else f"{press} takes no arguments")
            return key, f"{press} has no field '{key}'; {hint}"
    checked = {k: v for k, v in kwargs.items() if not any(v == s for s in skip_values)}
    for key, value in checked.items():
        annotation = fields[key].annotation
        if not _type_ok(value, annotation):
            return key, f"{press}.{key} is {annotation}, got {type(value).__name__} {value!r}"
        if key in RANGES and isinstance(value, (int, float)):
            low, inclusive = RANGES[key]
            if value < low or (value == low and not inclusive):
                return key, f"{press}.{key} must be {'>=' if inclusive else '>'} {low}, got {value!r}"
    values = {n: f.default for n, f in fields.items() if f.default is not NO_DEFAULT} | checked
    for test in _post_init_asserts(press):
        used = _fields_in(test)
        if not used & set(checked) or used & SET_BY_KVLAB:
            continue
        try:
            ok = _eval(test, values)
        except _Unknown:
            continue
        except TypeError:
            ok = False
        if not ok:
            key = sorted(used & set(checked))[0]
            rule = ast.unparse(test).replace("self.", "")
            return key, f"{press} requires {rule}, got {', '.join(f'{k}={checked[k]!r}' for k in sorted(used & set(checked)))}"
    return None


def is_subclass(press: str, base: str) -> bool:
    """Whether kvpress class `press` derives from `base` (by the class statements' bases)."""
    classes = _classes()
    return press == base or any(b in classes and is_subclass(b, base) for b in _base_names(classes.get(press, ast.ClassDef(name="", bases=[]))))


def wrapper_problem(wrapper: str, press: str) -> str | None:
    """What is wrong with wrapping `press` in `wrapper` (its ``isinstance(self.press, …)`` asserts), or None."""
    for test in _post_init_asserts(wrapper):
        if (isinstance(test, ast.Call) and getattr(test.func, "id", None) == "isinstance" and len(test.args) == 2
                and ast.unparse(test.args[0]) == "self.press"):
            wanted = [ast.unparse(e) for e in (test.args[1].elts if isinstance(test.args[1], ast.Tuple) else [test.args[1]])]
            if not any(is_subclass(press, w) for w in wanted):
                return f"{wrapper} wraps only a {' or '.join(wanted)}, and {press} is not one"
    return None


def suggest_press(name: str, presses) -> str | None:
    """'did you mean X?' for a press name close to one kvpress has, by spelling (difflib), case and a missing
    'Press' suffix ignored; None when nothing is close."""
    if "h2o" in name.lower():
        return "H2O is kvlab's own method (it scores at every decoding step): use `kind: h2o`"
    lower = {p.lower(): p for p in presses}
    for candidate in (name.lower(), name.lower().replace("_", "") + "press"):
        if candidate in lower:
            return f"did you mean {lower[candidate]}?"
    for candidate in (name.lower(), name.lower().replace("_", "") + "press"):
        close = difflib.get_close_matches(candidate, list(lower), n=1, cutoff=0.6)
        if close:
            return f"did you mean {lower[close[0]]}?"
    return None


@functools.cache
def kvpress_wrapper_names() -> frozenset[str]:
    """Exported presses that wrap another (a dataclass field `press`, declared or inherited), read from kvpress's
    sources like the names (once per process: every preset of every snakemake start is validated)."""
    spec = importlib.util.find_spec("kvpress")
    bases, wrappers = {}, set()
    for source in Path(spec.origin).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.ClassDef):
                bases[node.name] = {getattr(b, "id", None) for b in node.bases}
                if any(isinstance(s, ast.AnnAssign) and getattr(s.target, "id", None) == "press" for s in node.body):
                    wrappers.add(node.name)
    while grown := {c for c, b in bases.items() if b & wrappers} - wrappers:
        wrappers |= grown
    return frozenset(wrappers & kvpress_press_names())


def kvpress_press_names() -> set[str]:
    """Press classes kvpress exports, read from its __init__ without importing it (an import takes ~6 s)."""
    spec = importlib.util.find_spec("kvpress")
    if spec is None or spec.origin is None:
        return set()  # press_problem says "kvpress is not installed"
    tree = ast.parse(Path(spec.origin).read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names.update(a.asname or a.name for a in node.names)
    return {n for n in names if n.endswith("Press")}
