"""The plug-in registries (method kinds, quantization schemes, task kinds) agree with the config schema and
the README's "Extending kvlab" guide, and the scheme added through them (lmdeploy) stores what it should."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch
import yaml

from kvlab import tasks
from kvlab.state.config import ConfigError, load_schema, resolve
from kvlab.engine import evaluate_sample
from kvlab.state.jobs import run_params
from kvlab.kernels import kvcache, layouts
from kvlab.methods import KINDS, Variant, build, kind_of, variants
from kvlab.methods.schemes import SCHEMES

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = load_schema(ROOT / "workflow" / "config.schema.yaml")
README = (ROOT / "README.md").read_text()


def branches(definition: dict) -> set[str]:
    """The `kind` values a schema definition has an if/then branch for (not the rules for every kind but one)."""
    return {b["if"]["properties"]["kind"]["const"] for b in definition["allOf"] if "const" in b["if"]["properties"]["kind"]}


def test_method_kinds_are_the_schema_kinds_each_with_its_branch():
    method = SCHEMA["$defs"]["method"]
    assert set(KINDS) == set(method["properties"]["kind"]["enum"]) == branches(method)
    assert all(cls.name == name for name, cls in KINDS.items())


def test_schemes_are_the_schema_schemes_and_the_readme_table():
    quant = next(b["then"] for b in SCHEMA["$defs"]["method"]["allOf"] if b["if"]["properties"]["kind"]["const"] == "quant")
    assert set(SCHEMES) == set(quant["properties"]["scheme"]["enum"])
    assert all(cls.name == name for name, cls in SCHEMES.items())
    table = set(re.findall(r"^  - `(\w+)` — keys: ", README, flags=re.M))
    assert set(SCHEMES) <= table, set(SCHEMES) - table


def task_table() -> dict[str, set[str]]:
    """README's list of task kinds: each kind its item names (before the dash), with the names its parameters show."""
    lines = README.split("\n- **tasks** — ", 1)[1].split("\n")
    items = []
    for line in lines[: next(i for i, x in enumerate(lines) if x.startswith("- "))]:  # to the next key
        if line.startswith("  - "):
            items.append(line[4:])
        elif items and line.startswith("    "):
            items[-1] += " " + line.strip()
    rows = {}
    for item in items:
        kinds, _, rest = item.partition(" — ")
        params = rest.partition("; parameters: ")[2]
        rows |= {k: set(re.findall(r"`(\w+)`", params)) for k in re.findall(r"`(\w+)`", kinds)}
    return rows


def own_params(kind) -> set[str]:
    """A task kind's parameters beyond the ones every answered task takes (lengths, samples, seed, caps, rounds)."""
    shared = {f.name for f in dataclasses.fields(tasks.params.Answered)}
    return {f.name for f in dataclasses.fields(kind.Params)} - shared


def test_task_kinds_are_the_schema_kinds_each_named_once_with_a_shape_and_a_readme_row():
    task = SCHEMA["$defs"]["task"]
    assert list(tasks.KINDS) == task["properties"]["kind"]["enum"] and set(tasks.KINDS) == branches(task)
    assert all(kind.NAME == name and callable(kind.shape) and callable(kind.generate) for name, kind in tasks.KINDS.items())
    table = task_table()
    assert set(table) == set(tasks.KINDS), set(table) ^ set(tasks.KINDS)
    for name, kind in tasks.KINDS.items():
        assert own_params(kind) <= table[name], (name, own_params(kind) - table[name])


def test_no_code_outside_a_task_kind_branches_on_it():
    """No generator writes its kind's name in its samples (they take the module's NAME), and the rules, the run state,
    the engine, the jobs and the registry compare no task's kind with a name: what differs by kind is the kind's own
    (`shape`, `default_cap`, `reference_tokens`, `inputs`)."""
    src = ROOT / "src" / "kvlab"
    for path in (src / "tasks").glob("*.py"):
        assert not re.search(r"\bkind=[\"']", path.read_text()), path.name
    names = "|".join(tasks.KINDS)
    branch = re.compile(rf"""kind["'\]]*\s*(==|!=|in|not in)\s*[(\[{{]?\s*["']({names})["']""")
    assert branch.search('task["kind"] == "dataset"') and branch.search('self.kind in ("ruler", "dataset")')  # what it finds
    places = [ROOT / "Snakefile", *(ROOT / "rules").glob("*.smk"), src / "tasks" / "__init__.py", src / "tasks" / "base.py",
              *(src / "state").glob("*.py"), *(src / "engine").glob("*.py"), *(src / "steps").glob("*.py")]
    found = [(path.name, line.strip()) for path in places for line in path.read_text().splitlines() if branch.search(line)]
    assert not found, found


def test_the_guide_names_the_registries_where_they_are():
    guide = README[README.index("## Extending kvlab"):]
    for registry, path in (("KINDS", "src/kvlab/methods/__init__.py"), ("SCHEMES", "src/kvlab/methods/schemes/__init__.py"),
                           ("KINDS", "src/kvlab/tasks/__init__.py"),
                           ("SECTIONS", "src/kvlab/report/sections/__init__.py")):
        assert f"`{registry}` (`{path}`)" in " ".join(guide.split()), registry
        assert re.search(rf"^{registry}\b.*=", (ROOT / path).read_text(), flags=re.M), (registry, path)


def lmdeploy(bits: int, **kw) -> dict:
    return {"kind": "quant", "scheme": "lmdeploy", "bits": bits, "group": 32, **kw}


def test_lmdeploy_int4_stores_codes_and_one_scale_and_zero_per_token_and_head():
    """Hand count: 2 KV heads × 10 tokens × 16 channels at 4 bits = 160 bytes of codes per tensor, plus an fp16
    scale and zero point (4 bytes) per (token, head) = 80 bytes; keys and values alike, no residual."""
    h, d, t = 2, 16, 10
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(1, h, t, d, generator=g), torch.randn(1, h, t, d, generator=g)
    layer = kvcache.layer_from_dense(keys, values, kind_of(lmdeploy(4)).scheme.layer_spec(0, h, d))
    assert layer.counts() == {"sink_tokens": 0, "quantized_keys": t, "quantized_values": t, "residual_keys": 0, "residual_values": 0}
    assert layer.nbytes() == 2 * (160 + 80)
    key, value = kind_of(lmdeploy(4)).layouts(d)
    assert layouts.stored_layer_bytes(key, value, h, d, (t, t), (0, 0), 2) == 2 * (160 + 80)
    # asymmetric min–max per (token, head): every entry within half a step of its input
    k, _ = layer.full()
    step = (keys.amax(-1, keepdim=True) - keys.amin(-1, keepdim=True)) / 15
    assert ((k - keys).abs() <= step / 2 + 1e-3).all()


def test_lmdeploy_int8_is_the_int8_scheme():
    h, d = 2, 16
    keys, values = torch.randn(1, h, 12, d), torch.randn(1, h, 12, d)
    ours = kvcache.layer_from_dense(keys, values, kind_of(lmdeploy(8)).scheme.layer_spec(0, h, d))
    int8 = kvcache.layer_from_dense(keys, values, kind_of({"kind": "quant", "scheme": "int8", "bits": 4, "group": 32}).scheme.layer_spec(0, h, d))
    for tensor in ("key", "value"):
        for part, codes in int8.stored[tensor].items():
            assert torch.equal(ours.stored[tensor][part], codes), (tensor, part)


@pytest.mark.parametrize("bits", [4, 8])
def test_lmdeploy_rows_say_what_they_store(bits):
    v = Variant("lm", "quant", 1.0, {k: x for k, x in lmdeploy(bits).items() if k != "kind"})
    assert v.quantized and not v.evicts
    assert v.storage == {"scheme": "lmdeploy", "bits": bits, "key_axis": None, "value_axis": None, "policy": None}
    assert v.impl.scheme.residual == 0


def test_each_kinds_branch_is_made_from_its_declared_params():
    """The schema file holds no per-kind key: every branch allows exactly its kind's declared `Params` (and `kind`)."""
    assert not {"method", "task"} & set(yaml.safe_load((ROOT / "workflow" / "config.schema.yaml").read_text())["$defs"])
    for definition, registry in ((SCHEMA["$defs"]["method"], {k: c.Params for k, c in KINDS.items()}),
                                 (SCHEMA["$defs"]["task"], {k: m.Params for k, m in tasks.KINDS.items()})):
        for b in definition["allOf"]:
            params = registry[b["if"]["properties"]["kind"]["const"]]
            assert list(b["then"]["properties"]) == ["kind", *(f.name for f in dataclasses.fields(params))]
            assert all(p.get("description") for k, p in b["then"]["properties"].items() if k != "kind")


SKETCH = '''"""A method kind as a contributor adds one: this module, one line in KINDS, one config entry."""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.methods.base import NO_STORAGE, MethodKind, MethodParams
from kvlab.util.params import param


class Sketch(MethodKind):
    """The cache as prefilled, at every budget or once; its rows' `scheme` says its tag."""

    name = "sketch"

    @dataclass(kw_only=True)
    class Params(MethodParams):
        tag: str = param(doc="what its rows' scheme column says", pattern="^[a-z]+$")
        per_budget: bool = param(True, "run at every budget (else once, at budget 1.0)")

    @property
    def evicts(self) -> bool:
        return self.params["per_budget"]

    @property
    def storage(self) -> dict:
        return {**NO_STORAGE, "scheme": self.params["tag"]}
'''

ECHO = '''"""A task kind as a contributor adds one: this module and one line in KINDS."""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.util.params import param
from kvlab.tasks.base import Sample, chat_prompt
from kvlab.tasks.params import Answered

NAME = "echo"


def shape(sample: Sample) -> str:
    return "echo"


def default_cap(spec: dict) -> int:
    return 3  # a number of a few digits


@dataclass(kw_only=True)
class Params(Answered):
    words: int = param(40, "words of the document", minimum=1, maximum=1000)


def generate(name: str, spec: dict, tokenizer, context_tokens: int) -> list[Sample]:
    return [Sample(task=name, kind=NAME, sample_id=f"{name}-{i}", context_tokens=context_tokens, depth=None, seed=spec["seed"],
                   prompt=chat_prompt(tokenizer, " ".join(["plum"] * spec["words"] + [str(i)]), " Which number ends it?"),
                   gold=[str(i)]) for i in range(spec["samples"])]
'''


@pytest.fixture
def added_kinds(tmp_path, monkeypatch):
    """Kinds `sketch` (a method) and `echo` (a task), each a module written to `tmp_path` and one registry line,
    as README's "Extending kvlab" says to add them."""
    modules = {}
    for name, text in (("kvlab_sketch", SKETCH), ("kvlab_echo", ECHO)):
        (tmp_path / f"{name}.py").write_text(text)
        spec = importlib.util.spec_from_file_location(name, tmp_path / f"{name}.py")
        modules[name] = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, name, modules[name])
        spec.loader.exec_module(modules[name])
    monkeypatch.setitem(KINDS, "sketch", modules["kvlab_sketch"].Sketch)
    monkeypatch.setitem(tasks.KINDS, modules["kvlab_echo"].NAME, modules["kvlab_echo"])


@pytest.fixture
def config_with_added(added_kinds) -> dict:
    config = yaml.safe_load((ROOT / "config.yaml").read_text())
    config["methods"]["sketchy"] = {"kind": "sketch", "tag": "sk"}  # the one config entry
    config["tasks"]["echo"] = {"kind": "echo", "context_tokens": [256], "samples": 2}
    return config


def test_added_kinds_are_validated_by_the_schema_made_from_their_params(config_with_added):
    out = resolve(config_with_added, ROOT / "workflow" / "config.schema.yaml")
    assert out["methods"]["sketchy"] == {"kind": "sketch", "tag": "sk", "per_budget": True}
    assert out["tasks"]["echo"] == {"kind": "echo", "context_tokens": [256], "samples": 2, "seed": 0, "words": 40}
    bad = [
        (("methods", "sketchy"), {"kind": "sketch"}, "config: key 'methods.sketchy': missing required key 'tag'"),
        (("methods", "sketchy"), {"kind": "sketch", "tag": "SK"}, "config: key 'methods.sketchy.tag': 'SK' does not match ^[a-z]+$"),
        (("methods", "sketchy"), {"kind": "sketch", "tag": "sk", "per_budget": "yes"},
         "config: key 'methods.sketchy.per_budget': expected boolean, got str 'yes'"),
        (("methods", "sketchy"), {"kind": "sketch", "tag": "sk", "window": 4},
         "config: unknown key 'window' under 'methods.sketchy'; allowed: kind, per_budget, tag, tasks"),
        (("methods", "sketchy"), {"tag": "sk"}, "config: key 'methods.sketchy': missing 'kind' (required); one of: full, kvpress, h2o, "
         "quant, hf_quantized, block_sparse, cross_layer, prompt_compression, mikv, llamacpp, vllm, sketch"),
        (("tasks", "echo"), {"kind": "echo", "context_tokens": [256], "words": 0}, "config: key 'tasks.echo.words': 0 must be >= 1"),
        (("tasks", "echo"), {"kind": "echo", "words": 3}, "config: key 'tasks.echo': missing required key 'context_tokens'"),
        (("tasks", "echo"), {"kind": "echo", "context_tokens": [256], "depths": [0.5]},
         "config: unknown key 'depths' under 'tasks.echo'; allowed: context_tokens, kind, max_new_tokens, max_samples, samples, seed, words"),
        (("tasks", "echo"), {"kind": "eco", "context_tokens": [256]}, ", continuation, ruler, dataset, echo"),
    ]
    for (section, name), entry, message in bad:
        config = {**config_with_added, section: {**config_with_added[section], name: entry}}
        with pytest.raises(ConfigError) as info:
            resolve(config, ROOT / "workflow" / "config.schema.yaml")
        assert message in str(info.value), (entry, str(info.value))


def test_added_kinds_are_planned_and_evaluated(config_with_added, tiny):
    """The jobs the DAG plans for the added task carry the added method (at every budget), and the engine evaluates
    that task's samples with it: its rows say its tag, and the cache it leaves as prefilled matches the full one."""
    smoke = config_with_added["presets"]["smoke"]  # the smoke run's own methods and tasks (it replaces the top level's)
    smoke["methods"]["sketchy"], smoke["tasks"]["echo"] = config_with_added["methods"]["sketchy"], config_with_added["tasks"]["echo"]
    config = resolve({**config_with_added, "preset": "smoke"}, ROOT / "workflow" / "config.schema.yaml")
    run = run_params(config, build(config["methods"]), "echo")
    assert "sketchy" in run["methods"]
    grid = [v for v in variants(run["methods"], run["budgets"], "echo") if v.method in ("full", "sketchy")]
    assert [v.budget for v in grid if v.method == "sketchy"] == config["budgets"]
    model, tokenizer = tiny
    cap = tasks.max_new_tokens(config["tasks"]["echo"], config["max_new_tokens"])
    assert cap == 3 != config["max_new_tokens"]  # the kind's own default_cap
    for sample in tasks.generate("echo", config["tasks"]["echo"], tokenizer, 256):
        rows = evaluate_sample(model, tokenizer, sample, grid, ["agnostic"], cap)
        sketch = [r for r in rows if r["method"] == "sketchy"]
        assert len(sketch) == len(config["budgets"]) and {r["scheme"] for r in sketch} == {"sk"}
        assert {r["task_kind"] for r in rows} == {"echo"} and all(r["kl_vs_full"] == pytest.approx(0, abs=1e-6) for r in sketch)
        assert {r["shape"] for r in rows} == {"echo"} and max(r["new_tokens"] for r in rows) <= cap


def test_defaults_fill_entries_in_the_order_they_had_before_the_schema_was_generated():
    """Snakemake compares a job's params by repr, so the keys a config entry gets filled, and their order, must stay
    as they were when the branches were written by hand (a new order would rerun every job of an existing run)."""
    out = resolve(yaml.safe_load((ROOT / "config.yaml").read_text()), ROOT / "workflow" / "config.schema.yaml")
    assert list(out["methods"]["kivi4"]) == ["kind", "scheme", "bits", "group", "residual", "key_axis", "value_axis", "scales",
                                             "outliers", "sink_tokens", "kwargs"]
    assert list(out["methods"]["snapkv"]) == ["kind", "press", "kwargs"]  # wrapper_kwargs is never filled
    assert list(out["tasks"]["niah_single"]) == ["kind", "context_tokens", "depths", "samples", "seed", "haystack", "keys", "values",
                                                 "queries", "question_position"]


def run_in_a_copy(tmp_path, module: str, text: str, registry: str, edits: list[tuple[str, str]], section: str, name: str,
                  entry: dict, out: str):
    """The guide's steps in a copy of the package, run by Snakemake as a user runs it: the kind's `module` (a path
    under src/kvlab) with `text`, its line in KINDS (`edits` to the `registry` file, each `old` found exactly once)
    and one entry `name` under the smoke preset's `section`; returns the smoke config and the rows of job `out`."""
    import os
    import shutil

    import pandas as pd
    from conftest import snakemake, workflow_copy

    src = tmp_path / "src"
    shutil.copytree(ROOT / "src", src, ignore=shutil.ignore_patterns("__pycache__"))
    (src / "kvlab" / module).write_text(text)  # its module
    path = src / "kvlab" / registry
    code = path.read_text()
    for old, new in edits:  # its line in KINDS
        assert code.count(old) == 1, old
        code = code.replace(old, new)
    path.write_text(code)
    work = workflow_copy(tmp_path / "run")
    config = yaml.safe_load((work / "config.yaml").read_text())
    config["presets"]["smoke"][section][name] = entry  # its config entry
    (work / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    env = {**os.environ, "PYTHONPATH": str(src)}  # the copy's kvlab first (kvlab.kernels: the install's)
    proc = snakemake(work, out, "--config", "preset=smoke", timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return config["presets"]["smoke"], pd.read_parquet(work / out)


@pytest.mark.slow
def test_a_task_kind_added_in_a_copy_runs_in_the_smoke_preset(tmp_path):
    """A task kind is its module and one line in KINDS (with its import), in a copy of the package, then one config
    entry: Snakemake plans its job, and its rows carry the kind's name, its shape and its own decoding cap."""
    smoke, rows = run_in_a_copy(
        tmp_path, "tasks/echo.py", ECHO, "tasks/__init__.py",
        [("from kvlab.tasks import arithmetic, ", "from kvlab.tasks import arithmetic, echo, "), ("(needle, ", "(needle, echo, ")],
        "tasks", "echo", {"kind": "echo", "context_tokens": [256], "samples": 2}, "results/eval/tiny-qwen2/echo/256.parquet")
    assert set(rows["task_kind"]) == {"echo"} and set(rows["shape"]) == {"echo"} and set(rows["max_new_tokens"]) == {3}
    assert {"echo-0", "echo-1"} <= set(rows["sample_id"]) <= {"echo-0", "echo-1", "echo-2"}  # rounds: max_samples 3
    assert rows["prediction"].notna().all()
    methods = smoke["methods"]
    assert set(rows["method"]) == {m for m, entry in methods.items() if "tasks" not in entry}  # every method not kept to others


@pytest.mark.slow
def test_a_method_kind_added_in_a_copy_runs_in_the_smoke_preset(tmp_path):
    """The guide's steps in a copy of the package, run by Snakemake as a user runs it: the kind's module, its line in
    KINDS (with its import) and one config entry; the smoke preset's needle job evaluates it at every budget."""
    line = "from kvlab.methods.quantized import HFQuantized, Quant\n"
    smoke, rows = run_in_a_copy(
        tmp_path, "methods/sketch.py", SKETCH, "methods/__init__.py",
        [(line, line + "from kvlab.methods.sketch import Sketch\n"), ("PromptCompression,\n", "PromptCompression, Sketch,\n")],
        "methods", "sketchy", {"kind": "sketch", "tag": "sk"}, "results/eval/tiny-qwen2/niah_single/512.parquet")
    sketch = rows[rows["method"] == "sketchy"]
    assert set(sketch["budget"]) == set(smoke["budgets"]) and set(sketch["scheme"]) == {"sk"}
    assert sketch["prediction"].notna().all() and len(sketch) == len(rows[rows["method"] == "full"]) * 2
