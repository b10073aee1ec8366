"""Config loading: pick the preset, validate against the JSON schema (Snakemake's `validate`, which
also fills defaults), and turn the first problem into one line naming the key and what is allowed."""

from __future__ import annotations

import ast
import copy
import functools
import importlib.util
from pathlib import Path

import jsonschema
import yaml


class ConfigError(ValueError):
    """A config problem, described in one line."""


def resolve(config: dict, schema_path: str | Path) -> dict:
    """Return the validated config with the selected preset applied and defaults filled.

    Every preset is checked, not only the selected one, so a broken preset is found before it is used.
    """
    schema = yaml.safe_load(Path(schema_path).read_text())
    base = copy.deepcopy(config)
    _validate(base, schema, schema_path, where="config")
    presets = base.get("presets", {})
    name = base.get("preset", "default")
    if name != "default" and name not in presets:
        allowed = ", ".join(dict.fromkeys(["default", *presets]))
        raise ConfigError(f"config: key 'preset': unknown preset '{name}'; allowed: {allowed}")
    resolved = None
    for pname, overrides in {"default": {}, **presets}.items():
        candidate = copy.deepcopy({k: v for k, v in config.items() if k != "presets"})
        candidate.update(copy.deepcopy(overrides))
        candidate["preset"] = pname
        _validate(candidate, schema, schema_path, where=f"preset '{pname}'")
        _check_semantics(candidate, where=f"preset '{pname}'")
        if pname == name:
            resolved = candidate
    resolved["presets"] = presets
    return resolved


def _validate(data: dict, schema: dict, schema_path: str | Path, where: str) -> None:
    # Snakemake's validate fills defaults; on failure we re-run jsonschema to word the error ourselves.
    from snakemake.exceptions import WorkflowError
    from snakemake.utils import validate

    try:
        validate(data, str(Path(schema_path).resolve()))
    except WorkflowError:
        error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(data))
        raise ConfigError(f"{where}: {describe(error)}") from None


def describe(error: jsonschema.ValidationError) -> str:
    """One line: the key path, what is wrong, what would be right."""
    path = _path(error.absolute_path)
    v = error.validator
    if v == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        extra = sorted(set(error.instance) - set(allowed))
        where = f"under '{path}'" if path else "at top level"
        return f"unknown key {', '.join(repr(k) for k in extra)} {where}; allowed: {', '.join(allowed)}"
    if v == "enum":
        return f"key '{path}': {error.instance!r} is not allowed; allowed: {', '.join(map(str, error.validator_value))}"
    if v == "const":
        return f"key '{path}': {error.instance!r} must be {error.validator_value!r}"
    if v == "type":
        return f"key '{path}': expected {error.validator_value}, got {type(error.instance).__name__} {error.instance!r}"
    if v == "required":
        missing = error.message.split("'")[1]
        return f"key '{path or 'config'}': missing required key '{missing}'"
    if v in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"):
        op = {"minimum": ">=", "maximum": "<=", "exclusiveMinimum": ">", "exclusiveMaximum": "<", "multipleOf": "a multiple of"}[v]
        return f"key '{path}': {error.instance!r} must be {op} {error.validator_value}"
    if v == "pattern" and "propertyNames" in error.schema_path:
        return f"name {error.instance!r} under '{path}' must match {error.validator_value} (letters, digits, . _ -)"
    if v == "pattern":
        return f"key '{path}': {error.instance!r} does not match {error.validator_value}"
    if v in ("minItems", "minProperties"):
        return f"key '{path}': must not be empty"
    if v == "uniqueItems":
        return f"key '{path}': values must be unique, got {error.instance!r}"
    return f"key '{path}': {error.message}"


def _path(parts) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def _check_semantics(config: dict, where: str) -> None:
    """Checks a schema cannot express."""
    presses = kvpress_press_names()
    for name, method in config["methods"].items():
        unknown = [t for t in method.get("tasks", []) if t not in config["tasks"]]
        if unknown:
            raise ConfigError(f"{where}: key 'methods.{name}.tasks': no task {unknown[0]!r}; configured tasks: {', '.join(config['tasks'])}")
        if method["kind"] == "full" and "tasks" in method:
            raise ConfigError(f"{where}: key 'methods.{name}.tasks': the full reference runs on every task; remove it")
        if method["kind"] == "quant":
            _check_quant(name, method, where)
        for key in ("wrapper", "layer_budgets"):
            if key in method and "press" not in method:
                raise ConfigError(f"{where}: key 'methods.{name}.{key}': applies to a press; add `press` (e.g. SnapKVPress)")
        if "press" in method:
            press = method["press"]
            if press not in presses:
                close = [p for p in presses if p.lower().startswith(press.lower()[:4])]
                hint = f"; did you mean {', '.join(close)}?" if close else f"; kvpress has: {', '.join(sorted(presses))}"
                raise ConfigError(f"{where}: key 'methods.{name}.press': kvpress has no press '{press}'{hint}")
            if method.get("wrapper_kwargs") and "wrapper" not in method:
                raise ConfigError(f"{where}: key 'methods.{name}.wrapper_kwargs': needs a `wrapper` press to configure")
            wrapper = method.get("wrapper")
            if wrapper is not None and wrapper not in (wrappers := kvpress_wrapper_names()):
                what = "is a press that wraps no other" if wrapper in presses else "is not a kvpress press"
                raise ConfigError(f"{where}: key 'methods.{name}.wrapper': '{wrapper}' {what}; wrappers: {', '.join(sorted(wrappers))}")
            if "press" in method.get("wrapper_kwargs", {}):
                raise ConfigError(f"{where}: key 'methods.{name}.wrapper_kwargs.press': the wrapped press is `press`; remove it here")
            for key, value in method.get("kwargs", {}).items():
                if value == "calibrated" and key != "n_sink":
                    raise ConfigError(
                        f"{where}: key 'methods.{name}.kwargs.{key}': 'calibrated' is only available for n_sink "
                        "(StreamingLLM's sink count from calibration)"
                    )
            if method.get("layer_budgets") and press == "PyramidKVPress":
                raise ConfigError(f"{where}: key 'methods.{name}.layer_budgets': PyramidKVPress sets its own per-layer budgets; use it with SnapKVPress or another press")
            if "compression_ratio" in method.get("kwargs", {}):
                raise ConfigError(
                    f"{where}: key 'methods.{name}.kwargs.compression_ratio': set by `budgets`, remove it here"
                )
    if "full" not in {m["kind"] for m in config["methods"].values()}:
        raise ConfigError(f"{where}: key 'methods': needs one method of kind 'full' (the uncompressed reference)")
    if not any(m["evaluate"] for m in config["models"].values()):
        raise ConfigError(f"{where}: key 'models': no model has evaluate: true; at least one must be evaluated")
    bench = config["benchmark"]["task"]
    if bench not in config["tasks"] or config["tasks"][bench]["kind"] != "niah" or config["tasks"][bench]["question_position"] != "after":
        niah = [n for n, t in config["tasks"].items() if t["kind"] == "niah" and t["question_position"] == "after"]
        raise ConfigError(f"{where}: key 'benchmark.task': {bench!r} must name a niah task asking after the document; candidates: {', '.join(niah) or 'none'}")
    for name, task in config["tasks"].items():
        if task["kind"] == "niah" and task["queries"] > task["keys"]:
            raise ConfigError(f"{where}: key 'tasks.{name}.queries': {task['queries']} exceeds keys {task['keys']}; ask at most as many keys as there are")
        if task["kind"] == "common_words" and task["uncommon_freq"] >= task["common_freq"]:
            raise ConfigError(f"{where}: key 'tasks.{name}.uncommon_freq': must be below common_freq {task['common_freq']}")
        if task["kind"] == "recency" and max(task["from_end_tokens"]) >= min(task["context_tokens"]):
            raise ConfigError(f"{where}: key 'tasks.{name}.from_end_tokens': each must be below every context length ({min(task['context_tokens'])})")
        for n in task["context_tokens"]:
            for model, spec in config["models"].items():
                limit = spec.get("max_position_embeddings")
                if limit and n > limit:
                    raise ConfigError(
                        f"{where}: key 'tasks.{name}.context_tokens': {n} exceeds model '{model}' "
                        f"max_position_embeddings {limit}"
                    )


def _check_quant(name: str, method: dict, where: str) -> None:
    key = f"{where}: key 'methods.{name}"
    if method["scheme"] == "kvquant":
        if method["bits"] not in (2, 4):
            raise ConfigError(f"{key}.bits': kvquant uses the calibrated 2- or 4-bit grid, got {method['bits']}")
        if "press" in method:
            raise ConfigError(f"{key}.press': kvquant un-rotates keys with every prefill position and cannot follow eviction; use kivi, int8 or fp8 with a press")
    if method["scheme"] == "kivi" and method["group"] > 1 and method["group"] % (8 // method["bits"]):
        raise ConfigError(f"{key}.group': {method['bits']}-bit codes pack {8 // method['bits']} per byte; group must be a multiple of that")


CALIBRATION_TABLES = (
    "key_channels", "massive", "sinks", "concentration", "fp8_scales", "kvquant_ranges", "kvquant_grids", "layer_budget",
    "stream_sinks",
)  # what the calibrate rule writes per model (see kvlab.calibrate)


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
        raise ConfigError("kvpress is not installed; run `make setup`")
    tree = ast.parse(Path(spec.origin).read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names.update(a.asname or a.name for a in node.names)
    return {n for n in names if n.endswith("Press")}
