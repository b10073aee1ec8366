"""Config loading: pick the preset (laid over the top level, its tasks picked from the catalogue: kvlab.state.overlay),
validate against the JSON schema (Snakemake's `validate`, which also fills defaults), and turn the first problem
into one line naming the key and what is allowed."""

from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import yaml

from kvlab import tasks
from kvlab.kernels.accounting import Scheme
from kvlab.methods import KINDS, kind_of, press_source
from kvlab.state.overlay import CATALOG, OVERLAY, ConfigError, select_tasks, with_preset  # presets, the task catalogue
from kvlab.util import params


def check_config_files(base: str | Path | None, overlays=()) -> None:
    """Read the config files Snakemake loads more strictly than it does (it keeps the last of duplicate keys
    silently, and words a syntax error without file or line): `base` (the Snakefile's ``configfile:``, skipped
    when absent) and `overlays` (``--configfile``, merged into it key by key). One line on the first problem:
    file:line:column and what is wrong. An overlay's null value is refused too: merging cannot delete a key."""
    files = ([Path(base)] if base is not None and Path(base).is_file() else []) + [Path(f) for f in overlays]
    for path in files:
        check_yaml(path, overlay=bool(base is not None and Path(base).is_file()) and path in map(Path, overlays))


def check_yaml(path: str | Path, overlay: bool = False) -> None:
    """Refuse YAML syntax errors and duplicate mapping keys (and, in an `overlay`, null values), naming the place."""
    path = Path(path)
    try:
        root = yaml.compose(path.read_text(), Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        context = error.context or ""
        if context and error.context_mark and error.context_mark.line != getattr(mark, "line", None):
            context += f" (from line {error.context_mark.line + 1}, column {error.context_mark.column + 1}):"
        problem = " ".join(f"{context} {error.problem or ''}".split())
        raise ConfigError(f"{where}: YAML syntax error: {problem}; fix the file there") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {' '.join(str(error).split())}") from None
    if not overlay and not isinstance(root, yaml.MappingNode):
        what = ("empty" if root is None else "a list" if isinstance(root, yaml.SequenceNode)
                else f"the single value {root.value!r}")
        raise ConfigError(f"{path}: the config is {what}; it must be a mapping of keys (models, tasks, methods, ...) as in "
                          "the config.yaml kvlab ships (git checkout config.yaml restores it)")
    stack = [((), root)] if root is not None else []
    while stack:
        keys, node = stack.pop()
        if isinstance(node, yaml.SequenceNode):
            stack.extend(((*keys, i), item) for i, item in enumerate(node.value))
        if not isinstance(node, yaml.MappingNode):
            continue
        seen = {}
        for key_node, value_node in node.value:
            key = key_node.value
            at = f"{path}:{key_node.start_mark.line + 1}:{key_node.start_mark.column + 1}"
            name = _path((*keys, key))
            if key in seen:
                raise ConfigError(f"{at}: duplicate key '{name}' (first at line {seen[key] + 1}); YAML would keep only "
                                  "the last silently — keep one")
            seen[key] = key_node.start_mark.line
            if overlay and value_node.tag == "tag:yaml.org,2002:null":
                raise ConfigError(f"{at}: key '{name}' is null: a --configfile merges into config.yaml key by key and "
                                  "cannot delete a key; edit config.yaml or select a preset instead")
            stack.append(((*keys, key), value_node))


def resolve(config: dict, schema_path: str | Path) -> dict:
    """Return the validated config with the selected preset applied, its tasks made whole from `task_catalog` (which
    it leaves out: kvlab.state.overlay.select_tasks) and defaults filled.

    Every preset is checked, not only the selected one, so a broken preset is found before it is used; what this
    machine can run (`_check_machine`) only for the selected one.
    """
    schema = load_schema(schema_path)
    base = copy.deepcopy(config)
    if CATALOG in base:  # the catalogue first, so that a fault in an entry is named where it is written
        only = {**schema, "required": [], "properties": {CATALOG: schema["properties"][CATALOG]}}
        _validate({CATALOG: copy.deepcopy(base[CATALOG])}, only, where="config")
    select_tasks(base, where="config")  # the top level's tasks made whole from it
    _validate(base, schema, where="config")
    presets = base.get("presets", {})
    name = base.get("preset", "default")
    if name != "default" and name not in presets:
        allowed = ", ".join(dict.fromkeys(["default", *presets]))
        raise ConfigError(f"config: key 'preset': unknown preset '{name}'; allowed: {allowed}")
    resolved = None
    for pname in ["default", *presets]:
        candidate = with_preset(config, pname)
        try:
            _validate(candidate, schema, where=f"preset '{pname}'")
        except ConfigError as error:
            if "at top level; allowed:" not in str(error):
                raise
            raise ConfigError(f"{error}; and a preset's own: {', '.join(OVERLAY)}") from None
        _derive(candidate)
        _check_semantics(candidate, where=f"preset '{pname}'")
        if pname == name:
            _check_machine(candidate, where=f"preset '{pname}'")
            resolved = candidate
    resolved["presets"] = presets
    return resolved


def load_schema(schema_path: str | Path) -> dict:
    """The config schema: the file (workflow/config.schema.yaml), with `$defs.method` and `$defs.task` made from the
    method and task kinds' parameter declarations (their `Params`, kvlab.util.params), so a kind is declared once."""
    schema = yaml.load(Path(schema_path).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    schema["$defs"]["method"] = params.definition({name: kind.Params for name, kind in KINDS.items()})
    schema["$defs"]["task"] = params.definition({name: module.Params for name, module in tasks.KINDS.items()})
    return schema


def check_device(config: dict) -> None:
    """`device: cuda` needs a CUDA device torch can see on a machine that runs the jobs itself (rules/common.smk
    calls this for a local run, not for a dry run or a cluster submission, whose jobs run on GPU nodes)."""
    if config["device"] == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"preset '{config['preset']}': key 'device': 'cuda', but torch sees no CUDA device on this "
                              "machine; set device: cpu (--config device=cpu), or run where a GPU is (or submit with "
                              "--profile profiles/slurm)")


def dtype_floor_note(config: dict) -> str | None:
    """One line, said once before a local run's first job (rules/common.smk): the dtype noise floor `dtype_floor`
    asks for cannot be measured on this machine (an fp32 run where bf16 matmuls are emulated); None where it can,
    or where none is asked for. Each job of a listed task notes it in its own log as well."""
    from kvlab.util.hardware import compute_dtype, other_dtype

    floor = config["dtype_floor"]
    dtype = compute_dtype(config["dtype"], config["device"])
    if not floor["samples"] or not floor["tasks"] or other_dtype(dtype, config["device"]) is not None:
        return None
    return (f"kvlab: dtype_floor: {dtype} is the only dtype that runs in hardware here, so the jobs of "
            f"{', '.join(floor['tasks'])} measure no dtype noise floor (their dtype_noise_* columns stay empty)")


DISCRIMINATORS = {"methods": ("method", "kind"), "models": ("model", "source"), "task_catalog": ("task", "kind"),
                  "tasks": ("task", "kind")}


def _filling_defaults(validator_class):
    """A validator class that fills each property's schema `default` into the instance as it validates (the recipe of
    jsonschema's FAQ, which snakemake.utils.validate applies too). Ours because snakemake's validate re-reads and
    re-parses the schema file on every call: ten calls per `resolve` (the config, then each preset) took 80% of its
    0.8 s, paid by every job's Snakefile parse."""
    properties = validator_class.VALIDATORS["properties"]

    def set_defaults(validator, props, instance, schema):
        if isinstance(instance, dict):
            for name, sub in props.items():
                if "default" in sub:
                    instance.setdefault(name, sub["default"])
        yield from properties(validator, props, instance, schema)

    return jsonschema.validators.extend(validator_class, {"properties": set_defaults})


FillingValidator = _filling_defaults(jsonschema.Draft202012Validator)


def _validate(data: dict, schema: dict, where: str) -> None:
    """Validate `data` against the schema, filling defaults in place; a failure is one worded line."""
    _check_discriminators(data, schema, where)
    if next(FillingValidator(schema).iter_errors(data), None) is not None:
        error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(data))
        text = describe(error)
        parts = list(error.absolute_path)
        if error.validator == "pattern" and parts and parts[-1] in ("press", "wrapper") and isinstance(error.instance, str):
            close = press_source.suggest_press(error.instance, press_source.kvpress_press_names())
            text += f"; {close}" if close else ""
        raise ConfigError(f"{where}: {text}") from None


def _check_discriminators(data: dict, schema: dict, where: str) -> None:
    """An entry without its `kind` / `source` matches no branch of the schema, whose best error would be an
    'unknown key' of some other kind: say what is missing instead."""
    for section, (what, key) in DISCRIMINATORS.items():
        entries = data.get(section)
        if not isinstance(entries, dict):
            continue
        for name, entry in entries.items():
            if isinstance(entry, dict) and key not in entry:
                allowed = schema["$defs"][what]["properties"][key]["enum"]
                raise ConfigError(f"{where}: key '{section}.{name}': missing '{key}' (required); one of: {', '.join(allowed)}")




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
    if v == "oneOf" and all(set(sub) == {"required"} for sub in error.validator_value):  # one key of several
        keys = [sub["required"][0] for sub in error.validator_value]
        given = [k for k in keys if isinstance(error.instance, dict) and k in error.instance]
        return f"key '{path}': needs exactly one of {', '.join(keys)}, got {', '.join(given) if given else 'none'}"
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
    for name, method in config["methods"].items():
        unknown = [t for t in method.get("tasks", []) if t not in config["tasks"]]
        if unknown:
            raise ConfigError(f"{where}: key 'methods.{name}.tasks': no task {unknown[0]!r}; configured tasks: {', '.join(config['tasks'])}")
        if method["kind"] == "full" and "tasks" in method:
            raise ConfigError(f"{where}: key 'methods.{name}.tasks': the full reference runs on every task; remove it")
        for key in ("wrapper", "layer_budgets"):
            if key in method and "press" not in method:
                raise ConfigError(f"{where}: key 'methods.{name}.{key}': applies to a press; add `press` (e.g. SnapKVPress)")
        if problem := kind_of(method).problem():
            raise ConfigError(f"{where}: key 'methods.{name}.{problem[0]}': {problem[1]}")
    fulls = [n for n, m in config["methods"].items() if m["kind"] == "full"]
    if not fulls:
        raise ConfigError(f"{where}: key 'methods': needs one method of kind 'full' (the uncompressed reference)")
    if len(fulls) > 1:
        raise ConfigError(f"{where}: key 'methods': {len(fulls)} methods of kind 'full' ({', '.join(fulls)}); keep exactly one, "
                          "the uncompressed reference every method is compared with")
    for name, spec in config["models"].items():
        if spec["source"] == "tiny" and spec["heads"] % spec["kv_heads"]:
            raise ConfigError(f"{where}: key 'models.{name}.kv_heads': {spec['kv_heads']} does not divide heads {spec['heads']} "
                              "(each KV head serves a whole group of query heads); pick a divisor of heads")
    if not any(m["evaluate"] for m in config["models"].values()):
        raise ConfigError(f"{where}: key 'models': no model has evaluate: true; at least one must be evaluated")
    _check_reads(config["report"], where)
    _check_engines(config, where)
    unknown = [t for t in config["dtype_floor"]["tasks"] if t not in config["tasks"]]
    if unknown:
        raise ConfigError(f"{where}: key 'dtype_floor.tasks': no task {unknown[0]!r}; configured tasks: {', '.join(config['tasks'])}")
    bench = config["benchmark"]["task"]
    if "engine_vs_pipeline" in config["speed_benchmarks"] and (
            bench not in config["tasks"] or not tasks.needle.benchmarkable(config["tasks"][bench])):
        niah = [n for n, t in config["tasks"].items() if tasks.needle.benchmarkable(t)]
        raise ConfigError(f"{where}: key 'benchmark.task': {bench!r} must name a niah task asking after the document; candidates: "
                          f"{', '.join(niah) or 'none'}; or leave engine_vs_pipeline out of speed_benchmarks (e.g. "
                          "speed_benchmarks: [] for only the evaluation jobs)")
    for name, task in config["tasks"].items():
        if isinstance(task["samples"], list) and len(task["samples"]) != len(task["context_tokens"]):
            raise ConfigError(f"{where}: key 'tasks.{name}.samples': {len(task['samples'])} entries for "
                              f"{len(task['context_tokens'])} context_tokens; give one number, or one per context length")
        if problem := tasks.problem(name, task):
            raise ConfigError(f"{where}: key 'tasks.{name}.{problem[0]}': {problem[1]}")
        for n in task["context_tokens"]:
            for model, spec in config["models"].items():
                limit = spec.get("max_position_embeddings")
                if limit and n > limit:
                    raise ConfigError(
                        f"{where}: key 'tasks.{name}.context_tokens': {n} exceeds model '{model}' "
                        f"max_position_embeddings {limit}"
                    )


def _check_machine(config: dict, where: str) -> None:
    """The serving engines' caches the configured device of this machine can run (vLLM's FP8 on the CPU: AVX-512 or
    AMX; kvlab.methods.serving's `refusal`)."""
    for name, method in config["methods"].items():
        if refusal := kind_of(method).refusal(config["device"]):
            raise ConfigError(f"{where}: key 'methods.{name}': {refusal}")


def _check_engines(config: dict, where: str) -> None:
    """Methods a serving engine runs (kvlab.methods.serving): on models it can load (a GGUF file, for llama.cpp), and
    their kvlab twins methods kvlab's engine runs."""
    for name, method in config["methods"].items():
        kind = kind_of(method)
        if kind.engine is None:
            continue
        twin = method.get("kvlab_twin")
        if twin is not None and (twin not in config["methods"] or kind_of(config["methods"][twin]).engine is not None):
            ours = [n for n, m in config["methods"].items() if kind_of(m).engine is None and m["kind"] != "full"]
            raise ConfigError(f"{where}: key 'methods.{name}.kvlab_twin': {twin!r} is not a method kvlab's engine runs; one of: "
                              f"{', '.join(ours) or 'none configured'}")
        for model, spec in config["models"].items():
            if kind.reads_gguf and spec["evaluate"] and spec["source"] != "pypi-gguf":
                raise ConfigError(f"{where}: key 'methods.{name}': llama.cpp runs a model's GGUF file, and model {model!r} has "
                                  f"source {spec['source']}; evaluate a pypi-gguf model or leave the method out")


def _derive(config: dict) -> None:
    """Values that follow from others (each task kind's `derive`)."""
    for name, task in config["tasks"].items():
        tasks.derive(name, task)


def _check_reads(report: dict, where: str) -> None:
    """The cost table's read accounting: NSA's stride within its block, KV schemes the accounting parses."""
    nsa = report["sparse_reads"]["nsa"]
    if nsa["compress_stride"] > nsa["compress_block"]:
        raise ConfigError(f"{where}: key 'report.sparse_reads.nsa.compress_stride': {nsa['compress_stride']} exceeds "
                          f"compress_block {nsa['compress_block']} (blocks would skip tokens); use at most the block")
    for i, text in enumerate(report["crossover"]["kv_schemes"]):
        try:
            Scheme.parse(text)
        except ValueError as error:
            raise ConfigError(f"{where}: key 'report.crossover.kv_schemes[{i}]': {error}") from None


CALIBRATION_TABLES = (
    "key_channels", "massive", "sinks", "concentration", "fp8_scales", "kvquant_ranges", "kvquant_grids", "layer_budget",
    "stream_sinks",
)  # what the calibrate rule writes per model (see kvlab.steps.calibrate)


def expand(config: dict, schema_path: str | Path, name: str) -> dict:
    """Preset `name`'s effective config: laid over the top level (with_preset), validated, defaults filled, derived
    values added; without the presets themselves."""
    out = resolve({**config, "preset": name}, schema_path)
    out.pop("presets")
    return out


def main(argv: list[str] | None = None) -> None:
    """python -m kvlab.state.config: check config files as the workflow does before it runs, or print a preset's expansion."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(
        prog="python -m kvlab.state.config",
        description="Check config files for YAML syntax errors and duplicate keys (with file:line:column), as the "
                    "workflow does before it runs; or print a preset's effective config.")
    parser.add_argument("files", nargs="*", metavar="FILE", help="config files to check, e.g. config.yaml mine.yaml")
    parser.add_argument("--expand", metavar="PRESET", help="print preset PRESET of FILE (default config.yaml) laid over its "
                        "top level, validated, with defaults filled")
    args = parser.parse_args(argv)
    if args.expand is None and not args.files:
        parser.error("give the config files to check, or --expand PRESET")
    if args.expand is not None and len(args.files) > 1:
        parser.error("--expand reads one config file")
    try:
        if args.expand is not None:
            path = Path(args.files[0] if args.files else "config.yaml")
            check_yaml(path)
            schema = Path(__file__).resolve().parents[3] / "workflow" / "config.schema.yaml"
            print(yaml.safe_dump(expand(yaml.safe_load(path.read_text()), schema, args.expand), sort_keys=False), end="")
            return
        for arg in args.files:
            check_yaml(arg)
    except ConfigError as error:
        sys.exit(f"kvlab config: {error}")
    except OSError as error:
        sys.exit(f"kvlab config: {error.filename}: {error.strerror}")
    print(f"{len(args.files)} file(s) read: no duplicate keys, no syntax errors")


if __name__ == "__main__":
    main()
