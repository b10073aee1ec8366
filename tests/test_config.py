"""Config validation: defaults filled, presets applied, and each bad input stopped with one line."""

import copy
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvlab.state.config import ConfigError, dtype_floor_note, expand, load_schema, resolve
from kvlab.state.overlay import select_tasks

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = ROOT / "workflow" / "config.schema.yaml"


@pytest.fixture
def config():
    return yaml.safe_load((ROOT / "config.yaml").read_text())


def test_default_config_is_valid_and_defaults_filled(config):
    del config["budgets"], config["max_new_tokens"]
    out = resolve(config, SCHEMA)
    assert out["preset"] == "default"
    assert out["budgets"] == [0.5, 0.25, 0.1]
    assert out["max_new_tokens"] == 16
    assert out["models"]["qwen2.5-0.5b"]["dtype"] == "float32"
    assert out["methods"]["snapkv"]["kwargs"] == {"window_size": 32, "kernel_size": 5}
    assert out["tasks"]["recency"] == {
        "kind": "recency", "context_tokens": [1024], "from_end_tokens": [64, 192], "samples": 2, "seed": 0,
        "haystack": "noise",
    }
    assert out["noise_floor_samples"] == 4
    assert out["sequential"] == {"max_samples": 96, "round": 6}
    assert out["throughput"] == {"context_tokens": [1024], "new_tokens": 32, "batches": [1]}


@pytest.mark.parametrize("where,value", [("sequential", {"max_samples": -1}), ("sequential", {"round": 0}),
                                         ("sequential", {"rounds": 3}), ("task", -2)])
def test_sequential_settings_are_checked(config, where, value):
    if where == "task":
        config["tasks"]["niah_single"]["max_samples"] = value
    else:
        config["sequential"] = value
    with pytest.raises(ConfigError, match="max_samples|round"):
        resolve(config, SCHEMA)


def test_the_default_decides_and_the_study_keeps_the_wider_grid(config):
    """The default holds the tasks that decide the decision table and claims, with room for a lossless cell to be
    decided (at least 80 prompts); the study preset keeps arithmetic, RULER and the 2K-4K curves."""
    out = resolve(config, SCHEMA)
    assert set(out["tasks"]) == {"niah_single", "recency", "variable_tracking", "multi_turn", "prose_kl"}
    assert out["sequential"]["max_samples"] >= 80 and out["question_modes"][:2] == ["agnostic", "aware"]
    study = resolve({**config, "preset": "study"}, SCHEMA)
    assert {"arithmetic", "ruler_qa_1", "niah_single_long"} <= set(study["tasks"])


def test_at_least_one_model_is_evaluated(config):
    for spec in config["models"].values():
        spec["evaluate"] = False
    with pytest.raises(ConfigError, match="no model has evaluate: true"):
        resolve(config, SCHEMA)


def test_every_preset_covers_every_task_kind(config):
    """study (the wider study), wide, smoke (the CI run of the DAG), evidence and full exercise every generator the
    schema allows; the dataset kind's shipped example runs in study, wide and smoke, and smoke runs the prompts-only
    chat example too (evidence and full size the claims' cells)."""
    kinds = set(load_schema(SCHEMA)["$defs"]["task"]["properties"]["kind"]["enum"])
    for preset in ("study", "wide", "smoke", "evidence", "full"):
        out = resolve({**config, "preset": preset}, SCHEMA)
        expected = kinds - {"dataset"} if preset in ("evidence", "full") else kinds
        assert {t["kind"] for t in out["tasks"].values()} == expected, preset
        recipes = {name: t for name, t in out["tasks"].items() if t["kind"] == "dataset"}
        assert all(t["path"] == f"results/workloads/{name}.jsonl" for name, t in recipes.items())
        shipped = {"smoke": {"qa_mix", "chat_mix"}, "evidence": set(), "full": set()}.get(preset, {"qa_mix"})
        assert {t["recipe"] for t in recipes.values()} == shipped, preset


def test_ruler_preset_is_kvpress_leaderboard_grid(config):
    """RULER's 13 tasks at 4K with at least 100 samples each, both question modes, kvpress's compression ratios
    0.25–0.875 as kept shares, and quantized methods beside the presses."""
    from kvlab.tasks import ruler

    out = resolve({**config, "preset": "ruler"}, SCHEMA)
    rulers = {t["ruler_task"]: t for t in out["tasks"].values() if t["kind"] == "ruler"}
    assert sorted(rulers) == sorted(ruler.TASKS) and len(rulers) == 13
    assert all(t["context_tokens"] == [4096] and t["samples"] >= 100 for t in rulers.values())
    assert out["question_modes"] == ["agnostic", "aware"]
    assert sorted(1 - b for b in out["budgets"]) == [0.25, 0.5, 0.75, 0.875]
    kinds = {m["kind"] for m in out["methods"].values()}
    assert {"full", "kvpress", "quant"} <= kinds


def test_preset_replaces_top_level_keys(config):
    config["preset"] = "smoke"
    out = resolve(config, SCHEMA)
    assert list(out["models"]) == ["tiny-qwen2"]
    assert out["models"]["tiny-qwen2"]["seed"] == 0  # default filled inside the preset too
    assert out["budgets"] == [0.5, 0.25]  # set by the preset
    assert out["question_modes"] == resolve({**config, "preset": "default"}, SCHEMA)["question_modes"]  # not set by it
    assert out["methods"]["streaming_llm"]["kwargs"] == {"n_sink": "calibrated"}


PRESETS = list(yaml.safe_load((ROOT / "config.yaml").read_text())["presets"])


def _given(out, given, where):
    """`out` is what a preset `given`, validated: the same values, defaults filled in inside its mappings."""
    if isinstance(given, dict):
        assert isinstance(out, dict), where
        for key, value in given.items():
            _given(out[key], value, f"{where}.{key}")
    else:
        assert out == given, where


def _merged(out, base, change, where):
    """`change` merged into `base` (with_preset's rule): mappings key by key, recursively; a list or a value replaces;
    every key of `base` that `change` does not set is kept as it was."""
    if not (isinstance(base, dict) and isinstance(change, dict)):
        return _given(out, change, where)
    assert list(out)[:len(base)] == list(base) and set(out) == set(base) | set(change), where  # base's order, then new keys
    for key in out:
        if key in change:
            _merged(out[key], base.get(key), change[key], f"{where}.{key}")
        else:
            assert out[key] == base[key], f"{where}.{key}"


def _whole(config, preset):
    """`preset` with its own tasks (`replace: [tasks]`) made whole from the catalogue, as with_preset makes them."""
    if "tasks" not in preset.get("replace", []):
        return preset
    whole = {"task_catalog": config["task_catalog"], "tasks": copy.deepcopy(preset["tasks"])}
    select_tasks(whole, "test")
    return {**preset, "tasks": whole["tasks"]}


def _base(config, name):
    """The expanded config preset `name` lies over: the one it extends, or for default the top level alone."""
    if name == "default":
        return expand({**config, "presets": {}}, SCHEMA, "default")
    return expand(config, SCHEMA, (config["presets"][name] or {}).get("extends", "default"))


@pytest.mark.parametrize("name", PRESETS)
def test_a_preset_is_its_base_with_its_keys_laid_over(config, name, monkeypatch):
    """What config.yaml's `presets:` and with_preset promise, on each shipped preset's expansion (validated,
    defaults filled): a key it lists in `replace` is its own value whole; any other key it sets is merged into its
    base's; a key it does not set is its base's, unchanged; methods_drop / _add / _tasks move methods last. On a CPU
    that runs every preset (serving_vllm's FP8 needs AVX-512; its refusal elsewhere: test_serving)."""
    monkeypatch.setattr("kvlab.util.hardware.avx512_or_amx", lambda: True)
    _assert_laid_over(config, name)


def test_a_preset_merges_mappings_key_by_key_and_replaces_lists(config):
    """No shipped preset changes only part of a mapping whose other keys differ from the schema's defaults (where
    merging and replacing whole give the same expansion); this one does, in a task, a method and the decision."""
    config["presets"]["mine"] = {"tasks": {"niah_single": {"samples": 7, "depths": [0.5]}}, "decision": {"kl_safe": 0.02},
                                 "methods": {"snapkv": {"kwargs": {"window_size": 16}}}, "budgets": [0.5]}
    _assert_laid_over(config, "mine")
    base, out = expand(config, SCHEMA, "default"), expand(config, SCHEMA, "mine")
    assert out["tasks"] == {**base["tasks"], "niah_single": {**base["tasks"]["niah_single"], "samples": 7, "depths": [0.5]}}
    assert out["methods"]["snapkv"] == {**base["methods"]["snapkv"], "kwargs": {"window_size": 16, "kernel_size": 5}}
    assert out["decision"] == {**base["decision"], "kl_safe": 0.02} and out["budgets"] == [0.5]


def _assert_laid_over(config, name):
    preset = _whole(config, config["presets"][name] or {})
    base, out = _base(config, name), expand(config, SCHEMA, name)
    assert out["preset"] == name and set(out) == set(base)
    for key in set(out) - {"preset", "methods"}:
        if key in preset.get("replace", []):
            _given(out[key], preset[key], key)
            assert not isinstance(preset[key], dict) or list(out[key]) == list(preset[key]), key  # nothing of the base kept
        elif key in preset:
            _merged(out[key], base[key], preset[key], key)
        else:
            assert out[key] == base[key], key
    methods = preset.get("methods")
    if "methods" in preset.get("replace", []):
        before = {m: out["methods"][m] for m in methods}
        _given(before, methods, "methods")
    else:
        before = {**base["methods"], **{m: out["methods"][m] for m in methods or {}}}
        if methods:
            _merged(before, base["methods"], methods, "methods")
    drop, add, retask = preset.get("methods_drop", []), preset.get("methods_add", {}), preset.get("methods_tasks", {})
    assert set(drop) <= set(before) and not set(add) & set(before), "methods_drop names a method, methods_add a new one"
    assert list(out["methods"]) == [m for m in before if m not in drop] + list(add)
    for m, spec in out["methods"].items():
        if m in retask:
            assert spec.get("tasks", "all") == retask[m] and {**spec, "tasks": 0} == {**(before | add)[m], "tasks": 0}, m
        elif m in add:
            _given(spec, add[m], f"methods_add.{m}")
        else:
            assert spec == before[m], m


@pytest.mark.parametrize("name", ["default", *PRESETS])
def test_every_name_a_preset_gives_exists(config, name, monkeypatch):
    """Each preset validates on its own, and every task it names (a method's `tasks`, methods_tasks, the dtype floor,
    and the engine-vs-pipeline benchmark where it runs) is one of its tasks. On a CPU that runs every
    preset (serving_vllm's FP8 needs AVX-512)."""
    monkeypatch.setattr("kvlab.util.hardware.avx512_or_amx", lambda: True)
    out = resolve({**config, "preset": name}, SCHEMA)
    assert out["preset"] == name
    retask = (config["presets"].get(name) or {}).get("methods_tasks", {})
    named = {t for m in out["methods"].values() for t in m.get("tasks", [])}
    named |= {t for each in retask.values() if each != "all" for t in each} | set(out["dtype_floor"]["tasks"])
    if "engine_vs_pipeline" in out.get("speed_benchmarks", ["engine_vs_pipeline"]):
        named.add(out["benchmark"]["task"])
    assert named <= set(out["tasks"])


def test_smoke_runs_the_tiny_model_alone_in_fp32(config):
    """The smoke preset is its own world: one tiny random model (no download), exact in fp32, every method of its own."""
    out = expand(config, SCHEMA, "smoke")
    assert [(m["source"], m["evaluate"]) for m in out["models"].values()] == [("tiny", True)]
    assert out["dtype"] == "float32" and list(out["methods"]) == list(config["presets"]["smoke"]["methods"])


def test_overlays_add_drop_retask_merge_and_extend(config):
    """A preset of a user's own: from the workload preset, one method more, one less, one on other tasks; a nested
    key merged (sequential.round kept) and a replaced one."""
    config["presets"]["mine"] = {"extends": "workload", "methods_add": {"int8": {"kind": "quant", "scheme": "int8"}},
                                 "methods_drop": ["streaming_llm"], "methods_tasks": {"kivi4": ["qa_mix"], "kivi2": ["qa_mix"]},
                                 "sequential": {"max_samples": 24}, "replace": ["dtype_floor"],
                                 "dtype_floor": {"samples": 2, "tasks": ["qa_mix"]}}
    out = resolve({**config, "preset": "mine"}, SCHEMA)
    workload = resolve({**config, "preset": "workload"}, SCHEMA)
    assert list(out["methods"]) == [m for m in workload["methods"] if m != "streaming_llm"] + ["int8"]
    assert out["methods"]["kivi4"]["tasks"] == ["qa_mix"] and "tasks" not in out["methods"]["snapkv"]
    assert out["sequential"] == {**workload["sequential"], "max_samples": 24}
    assert out["dtype_floor"] == {"samples": 2, "tasks": ["qa_mix"], "max_context_tokens": 8192} and out["tasks"] == workload["tasks"]


@pytest.mark.parametrize("preset, message", [
    ({"methods_drop": ["nope"]}, "preset 'mine': key 'methods_drop': no method 'nope' to drop; methods here: full, snapkv"),
    ({"methods_add": {"fp8": {"kind": "full"}}}, "preset 'mine': key 'methods_add.fp8': method 'fp8' exists already; change its tasks"),
    ({"methods_tasks": {"nope": "all"}}, "preset 'mine': key 'methods_tasks.nope': no method 'nope'; methods here: full"),
    ({"methods_tasks": {"fp8": ["nope"]}}, "preset 'mine': key 'methods.fp8.tasks': no task 'nope'; configured tasks: niah_single"),
    ({"extends": "nope"}, "preset 'mine': key 'extends': unknown preset 'nope'; allowed: default, study"),
    ({"extends": "mine"}, "preset 'mine': presets extend each other in a circle (mine → mine); one of them must extend default"),
    ({"replace": ["tasks"]}, "preset 'mine': key 'replace': ['tasks']; it must list config keys this preset sets"),
    ({"methods_drop": "fp8"}, "preset 'mine': key 'methods_drop': 'fp8'; it must be a list of method names"),
    ({"method_add": {}}, "preset 'mine': unknown key 'method_add' at top level; allowed: benchmark,"),
])
def test_a_bad_overlay_is_one_line(config, preset, message):
    config["presets"]["mine"] = preset
    with pytest.raises(ConfigError) as error:
        resolve(config, SCHEMA)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)
    if "unknown key" in message:
        assert str(error.value).endswith("; and a preset's own: extends, replace, methods_add, methods_drop, methods_tasks")


def test_a_preset_picks_catalogue_tasks_and_changes_only_what_it_gives(config):
    """`tasks` names catalogue entries: each is the entry with the preset's keys laid over it (a changed key keeps the
    catalogue's place, a new one follows: job params compare by their printed form); `from` picks an entry under
    another name; an entry with `kind` is its own; a preset extending another changes what that one picked. The
    catalogue itself is not part of the effective config."""
    catalog = config["task_catalog"]
    own = {"kind": "recency", "context_tokens": [512], "from_end_tokens": [64], "samples": 1}
    config["presets"]["mine"] = {"tasks": {"niah_single": {"context_tokens": [8192], "max_samples": 40},
                                           "needle_4k": {"from": "niah_single", "samples": 3}, "mine": own}}
    config["presets"]["more"] = {"extends": "mine", "tasks": {"niah_single": {"samples": 5}}}
    out = expand(config, SCHEMA, "mine")
    assert "task_catalog" not in out and list(out["tasks"]) == [*config["tasks"], "needle_4k", "mine"]
    mine, defaults = out["tasks"]["niah_single"], ["seed", "haystack", "keys", "values", "queries", "question_position"]
    assert list(mine) == [*catalog["niah_single"], "max_samples", *defaults]
    assert mine == {**out["tasks"]["needle_4k"], "context_tokens": [8192], "samples": catalog["niah_single"]["samples"],
                    "max_samples": 40}
    assert {k: out["tasks"]["needle_4k"][k] for k in catalog["niah_single"]} == {**catalog["niah_single"], "samples": 3}
    assert {k: out["tasks"]["mine"][k] for k in own} == own
    more = expand(config, SCHEMA, "more")["tasks"]["niah_single"]
    assert more == {**mine, "samples": 5} and list(more) == list(mine)
    assert expand(config, SCHEMA, "default")["tasks"]["niah_single"]["context_tokens"] == catalog["niah_single"]["context_tokens"]


@pytest.mark.parametrize("tasks, message", [
    ({"nope": {"samples": 2}}, "preset 'mine': key 'tasks.nope': no task 'nope' in task_catalog (niah_single, niah_prose, "),
    ({"x": {"from": "nope"}}, "preset 'mine': key 'tasks.x.from': no task 'nope' in task_catalog (niah_single, niah_prose, "),
])
def test_an_unknown_catalogue_name_is_one_line_naming_the_preset_and_the_known_names(config, tasks, message):
    config["presets"]["mine"] = {"replace": ["tasks"], "tasks": tasks}
    with pytest.raises(ConfigError) as error:
        resolve(config, SCHEMA)
    text = str(error.value)
    assert text.startswith(message) and "\n" not in text and all(name in text for name in config["task_catalog"])
    assert text.endswith("; pick one by name (or by `from`), or give `kind` for a task of its own")


def test_config_yaml_defines_each_task_once(config):
    """Every task definition of config.yaml is written once: the catalogue's entries and the tasks of their own (with
    `kind`) differ from each other, a pick restates no key of the entry it picks, every entry is picked somewhere,
    and no preset writes a task that its pick of the catalogue would give."""
    catalog = config["task_catalog"]
    writes = [("tasks", config["tasks"])] + [(f"presets.{p}.tasks", (spec or {}).get("tasks", {}))
                                             for p, spec in config["presets"].items()]
    definitions = [("task_catalog", name, entry) for name, entry in catalog.items()]
    picked = set()
    for where, tasks in writes:
        for name, entry in tasks.items():
            if "kind" in entry:
                definitions.append((where, name, entry))
                continue
            source = entry.get("from", name)
            picked.add(source)
            restated = [k for k, v in entry.items() if k != "from" and catalog[source].get(k) == v]
            assert not restated, f"{where}.{name} restates {restated} of task_catalog.{source}"
    for i, (where, name, entry) in enumerate(definitions):
        for other_where, other, again in definitions[i + 1:]:
            assert entry != again, f"{other_where}.{other} repeats {where}.{name}"
    assert set(catalog) <= picked, f"catalogue entries no task picks: {sorted(set(catalog) - picked)}"
    text = (ROOT / "config.yaml").read_text()
    assert text.count(catalog["qa_mix"]["template"].encode("unicode_escape").decode()) == 1

def edit(config, path, value):
    """Set (or delete) the value at `path`; a method or task only the study preset defines is first added to the
    default's."""
    study = config["presets"]["study"]
    if path[0] in ("methods", "tasks") and len(path) > 2 and path[1] not in config[path[0]]:
        config[path[0]][path[1]] = copy.deepcopy({**study.get(path[0], {}), **study.get(f"{path[0]}_add", {})}[path[1]])
    node = config
    *head, last = path
    for key in head:
        node = node[key]
    if value is DELETE:
        del node[last]
    else:
        node[last] = value
    return config


DELETE = object()

BAD = [
    (("budgets",), [1.5], "config: key 'budgets[0]': 1.5 must be <= 1"),
    (("budgets",), [0], "config: key 'budgets[0]': 0 must be > 0"),
    (("question_modes",), ["sometimes"], "config: key 'question_modes[0]': 'sometimes' is not allowed; allowed: agnostic, aware, multi_turn"),
    (("device",), "tpu", "config: key 'device': 'tpu' is not allowed; allowed: cpu, cuda"),
    (("max_new_tokens",), "many", "config: key 'max_new_tokens': expected integer, got str 'many'"),
    (("methods", "snapkv", "kwarg"), {},
     "config: unknown key 'kwarg' under 'methods.snapkv'; allowed: kind, kwargs, layer_budgets, press, tasks, wrapper, wrapper_kwargs"),
    (("methods", "snapkv", "wrapper"), "MergePress",
     "preset 'default': key 'methods.snapkv.wrapper': 'MergePress' is not a kvpress press; wrappers: AdaKVPress, BlockPress, ChunkKVPress, ChunkPress, "
     "CriticalAdaKVPress, DMSPress, EntropyGatedChunkKVPress, KeyRerotationPress, LUKVPress, MergingPress, PerLayerCompressionPress"),
    (("methods", "snapkv", "wrapper"), "KnormPress", "key 'methods.snapkv.wrapper': 'KnormPress' is a press that wraps no other; wrappers: AdaKVPress,"),
    (("methods", "snapkv", "wrapper_kwargs"), {"similarity_threshold": 0.5},
     "preset 'default': key 'methods.snapkv.wrapper_kwargs': needs a `wrapper` press to configure"),
    (("methods", "snapkv_merge", "wrapper_kwargs"), {"press": "X"},
     "key 'methods.snapkv_merge.wrapper_kwargs.press': the wrapped press is `press`; remove it here"),
    (("methods", "kivi4", "wrapper"), "MergingPress", "preset 'default': key 'methods.kivi4.wrapper': applies to a press; add `press` (e.g. SnapKVPress)"),
    (("methods", "kivi4", "layer_budgets"), "calibrated", "preset 'default': key 'methods.kivi4.layer_budgets': applies to a press; add `press`"),
    (("methods", "pyramidkv", "layer_budgets"), "calibrated", "key 'methods.pyramidkv.layer_budgets': PyramidKVPress sets its own per-layer budgets"),
    (("methods", "snapkv", "layer_budgets"), "pyramid", "config: key 'methods.snapkv.layer_budgets': 'pyramid' must be 'calibrated'"),
    (("methods", "kivi4", "scheme"), "kivi9", "config: key 'methods.kivi4.scheme': 'kivi9' is not allowed; allowed: fp8, ggml, int8, kivi, kvquant, lmdeploy"),
    (("methods", "lmdeploy4", "bits"), 2, "preset 'default': key 'methods.lmdeploy4.bits': lmdeploy quantizes KV to 4 or 8 bits (quant_policy 4 / 8), got 2"),
    (("methods", "kivi4", "bits"), 3, "config: key 'methods.kivi4.bits': 3 is not allowed; allowed: 2, 4, 8"),
    (("methods", "kvquant4", "bits"), 8, "preset 'default': key 'methods.kvquant4.bits': kvquant uses the calibrated 2- or 4-bit grid, got 8"),
    (("methods", "kvquant4", "press"), "SnapKVPress", "key 'methods.kvquant4.press': kvquant un-rotates keys with every prefill position"),
    (("methods", "kivi2", "group"), 2, "preset 'default': key 'methods.kivi2.group': 2-bit codes pack 4 per byte; group must be a multiple of that"),
    (("methods", "kivi2", "residual"), 48,
     "preset 'default': key 'methods.kivi2.residual': policy kivi quantizes per-channel codes R tokens at a time, in whole groups: residual must be a positive "
     "multiple of group 32, got 48 (or set policy: together)"),
    (("methods", "int8", "policy"), "together",
     "preset 'default': key 'methods.int8.policy': policy applies to scheme kivi only; scheme int8 quantizes by its own fixed rule: remove policy"),
    (("methods", "int8", "max_saturated"), 0.01,
     "preset 'default': key 'methods.int8.max_saturated': max_saturated applies to scheme fp8 only (scheme int8's min-max "
     "or grid range clamps nothing): remove it"),
    (("tasks", "mine"), {"kind": "dataset"}, "config: key 'tasks.mine': needs exactly one of path, recipe, got none"),
    (("tasks", "mine"), {"kind": "dataset", "path": "a.jsonl", "recipe": "qa_mix"},
     "config: key 'tasks.mine': needs exactly one of path, recipe, got path, recipe"),
    (("tasks", "mine"), {"kind": "dataset", "path": "/nonexistent/rows.jsonl"},
     "preset 'default': key 'tasks.mine.path': /nonexistent/rows.jsonl: no such file or folder; give `path` relative to the working directory or absolute"),
    (("tasks", "mine"), {"kind": "dataset", "recipe": "qa_mix", "samples": 200},
     "preset 'default': key 'tasks.mine.samples': 200 exceeds recipe_rows 120 (120); draw at most 120"),
    (("tasks", "mine"), {"kind": "dataset", "recipe": "qa_mix", "template": "Q: {question}\nD: {context}"},
     "preset 'default': key 'tasks.mine.template': puts {question} before {context}"),
    (("tasks", "mine"), {"kind": "dataset", "recipe": "qa_mix", "metric": "bleu"}, "config: key 'tasks.mine.metric': 'bleu' is not allowed; allowed: qa_f1,"),
    (("methods", "kivi2", "policy"), "fifo", "config: key 'methods.kivi2.policy': 'fifo' is not allowed; allowed: kivi, together"),
    (("methods", "kivi2", "tasks"), ["niah"], "preset 'default': key 'methods.kivi2.tasks': no task 'niah'; configured tasks: niah_single"),
    (("methods", "full", "tasks"), ["prose_kl"], "key 'methods.full.tasks': the full reference runs on every task; remove it"),
    (("methods", "hf_quanto4"), {"kind": "hf_quantized", "bits": 8}, "config: key 'methods.hf_quanto4.bits': 8 is not allowed; allowed: 2, 4"),
    (("methods", "snapkv", "press"), "SnapKV",
     "config: key 'methods.snapkv.press': 'SnapKV' does not match ^[A-Z][A-Za-z0-9]*Press$; did you mean SnapKVPress?"),
    (("methods", "snapkv", "press"), "snapkvpress",
     "config: key 'methods.snapkv.press': 'snapkvpress' does not match ^[A-Z][A-Za-z0-9]*Press$; did you mean SnapKVPress?"),
    (("methods", "streaming_llm", "press"), "streaming_llm",
     "key 'methods.streaming_llm.press': 'streaming_llm' does not match ^[A-Z][A-Za-z0-9]*Press$; did you mean StreamingLLMPress?"),
    (("methods", "snapkv", "press"), "TovaPress", "preset 'default': key 'methods.snapkv.press': kvpress has no press 'TovaPress'; did you mean TOVAPress?"),
    (("methods", "snapkv", "press"), "H2OPress",
     "key 'methods.snapkv.press': kvpress has no press 'H2OPress'; H2O is kvlab's own method (it scores at every decoding step): use `kind: h2o`"),
    (("methods", "snapkv", "wrapper"), "MergePress", "preset 'default': key 'methods.snapkv.wrapper': 'MergePress' is not a kvpress press; wrappers:"),
    (("methods", "snapkv", "kwargs", "windowsize"), 32,
     "preset 'default': key 'methods.snapkv.kwargs.windowsize': SnapKVPress has no field 'windowsize'; did you mean window_size?"),
    (("methods", "snapkv", "kwargs", "window_size"), 0,
     "preset 'default': key 'methods.snapkv.kwargs.window_size': SnapKVPress.window_size must be > 0, got 0"),
    (("methods", "snapkv", "kwargs", "kernel_size"), -1, "key 'methods.snapkv.kwargs.kernel_size': SnapKVPress.kernel_size must be > 0, got -1"),
    (("methods", "snapkv", "kwargs", "kernel_size"), "five", "key 'methods.snapkv.kwargs.kernel_size': SnapKVPress.kernel_size is int, got str 'five'"),
    (("methods", "streaming_llm", "kwargs", "n_sink"), -2, "key 'methods.streaming_llm.kwargs.n_sink': StreamingLLMPress.n_sink must be >= 0, got -2"),
    (("methods", "streaming_llm", "kwargs", "n_sinks"), 4,
     "key 'methods.streaming_llm.kwargs.n_sinks': StreamingLLMPress has no field 'n_sinks'; did you mean n_sink?"),
    (("methods", "snapkv_merge", "wrapper_kwargs"), {"merge_fraction": 1.5},
     "preset 'default': key 'methods.snapkv_merge.wrapper_kwargs.merge_fraction': MergingPress requires 0.0 < merge_fraction <= 1.0, got merge_fraction=1.5"),
    (("methods", "snapkv_merge", "wrapper_kwargs"), {"similarity": 0.5},
     "key 'methods.snapkv_merge.wrapper_kwargs.similarity': MergingPress has no field 'similarity'; did you mean similarity_threshold?"),
    (("methods", "adakv", "wrapper_kwargs"), {"alpha_safeguard": 2},
     "key 'methods.adakv.wrapper_kwargs.alpha_safeguard': AdaKVPress requires 0 <= alpha_safeguard <= 1, got alpha_safeguard=2"),
    (("methods", "streaming_llm_rerotated", "wrapper_kwargs"), {"n_sink": 4},
     "key 'methods.streaming_llm_rerotated.wrapper_kwargs.n_sink': KeyRerotationPress has no field 'n_sink'; KeyRerotationPress takes no arguments"),
    (("methods", "snapkv_merge"), {"kind": "kvpress", "press": "ThinKPress", "wrapper": "MergingPress"},
     "preset 'default': key 'methods.snapkv_merge.wrapper': MergingPress wraps only a ScorerPress, and ThinKPress is not one"),
    (("methods", "full2"), {"kind": "full"}, "preset 'default': key 'methods': 2 methods of kind 'full' (full, full2); keep exactly one"),
    (("methods", "snapkv", "kind"), DELETE,
     "config: key 'methods.snapkv': missing 'kind' (required); one of: full, kvpress, h2o, quant, hf_quantized, block_sparse, cross_layer, prompt_compression"),
    (("methods", "moba", "selector"), DELETE, "config: key 'methods.moba': missing required key 'selector'"),
    (("methods", "moba", "selector"), "nsa", "config: key 'methods.moba.selector': 'nsa' is not allowed; allowed: moba, quest"),
    (("methods", "moba", "block"), 0, "config: key 'methods.moba.block': 0 must be >= 1"),
    (("methods", "cla2", "every"), 0, "config: key 'methods.cla2.every': 0 must be >= 1"),
    (("methods", "cla2", "press"), "SnapKVPress", "config: unknown key 'press' under 'methods.cla2'; allowed: every, kind, tasks"),
    (("models", "qwen2.5-0.5b", "source"), DELETE, "config: key 'models.qwen2.5-0.5b': missing 'source' (required); one of: pypi-gguf, hub, tiny"),
    (("task_catalog", "recency", "kind"), DELETE, "config: key 'task_catalog.recency': missing 'kind' (required); one of: niah, recency"),
    (("models", "tiny-x"), {"source": "tiny", "heads": 4, "kv_heads": 3},
     "preset 'default': key 'models.tiny-x.kv_heads': 3 does not divide heads 4 (each KV head serves a whole group of query heads); pick a divisor of heads"),
    (("methods", "snapkv", "press"), "SnapPress", "preset 'default': key 'methods.snapkv.press': kvpress has no press 'SnapPress'; did you mean SnapKVPress?"),
    (("methods", "snapkv", "kwargs", "compression_ratio"), 0.5, "key 'methods.snapkv.kwargs.compression_ratio': set by `budgets`, remove it here"),
    (("methods", "full"), DELETE, "key 'methods': needs one method of kind 'full'"),
    (("models", "qwen2.5-0.5b", "gguf"), "llama-9000",
     "config: key 'models.qwen2.5-0.5b.gguf': 'llama-9000' is not allowed; allowed: qwen2.5-coder-0.5b-instruct-q4_k_m"),
    (("models", "qwen2.5-0.5b", "source"), "ftp", "config: key 'models.qwen2.5-0.5b.source': 'ftp' is not allowed; allowed: pypi-gguf, hub, tiny"),
    (("models", "bad/name"), {"source": "tiny"}, "config: name 'bad/name' under 'models' must match"),
    (("tasks", "niah_single", "context_tokens"), [64], "config: key 'tasks.niah_single.context_tokens[0]': 64 must be >= 128"),
    (("tasks", "niah_single", "kind"), "haystack",
     "config: key 'tasks.niah_single.kind': 'haystack' is not allowed; allowed: niah, recency, variable_tracking, multi_turn, common_words, frequent_words, "
     "arithmetic, continuation"),
    (("tasks", "niah_single", "depths"), [], "config: key 'tasks.niah_single.depths': must not be empty"),
    (("tasks", "niah_single", "haystack"), "essays", "config: key 'tasks.niah_single.haystack': 'essays' is not allowed; allowed: noise, prose"),
    (("tasks", "niah_single", "hops"), 3, "config: unknown key 'hops' under 'tasks.niah_single'; allowed: context_tokens, depths, haystack, keys"),
    (("tasks", "niah_multiquery"), {"kind": "niah", "keys": 3, "queries": 5, "context_tokens": [1024]},
     "preset 'default': key 'tasks.niah_multiquery.queries': 5 exceeds keys 3"),
    (("tasks", "niah_single", "samples"), [4, 2], "preset 'default': key 'tasks.niah_single.samples': 2 entries for 1 context_tokens; "
     "give one number, or one per context length"),
    (("tasks", "niah_single", "samples"), [0], "config: key 'tasks.niah_single.samples[0]': 0 must be >= 1"),
    (("tasks", "recency", "from_end_tokens"), [2000], "preset 'default': key 'tasks.recency.from_end_tokens': each must be below every context length (1024)"),
    (("task_catalog", "recency", "from_end_tokens"), DELETE, "config: key 'task_catalog.recency': missing required key 'from_end_tokens'"),
    (("tasks", "recency", "from_end_tokens"), [2000, 64], "preset 'default': key 'tasks.recency.from_end_tokens': each must be below"),
    (("task_catalog", "recency", "samples"), 0, "config: key 'task_catalog.recency.samples': 0 must be >= 1"),
    (("tasks", "niah_single", "from"), "nope", "config: key 'tasks.niah_single.from': no task 'nope' in task_catalog (niah_single, "),
    (("tasks", "common_words", "uncommon_freq"), 10, "preset 'default': key 'tasks.common_words.uncommon_freq': must be below common_freq 10"),
    (("tasks", "prose_kl", "continuation_tokens"), 1, "config: key 'tasks.prose_kl.continuation_tokens': 1 must be >= 2"),
    (("benchmark", "task"), "recency",
     "preset 'default': key 'benchmark.task': 'recency' must name a niah task asking after the document; candidates: niah_single"),
    (("methods", "snapkv", "kwargs", "window_size"), "calibrated", "key 'methods.snapkv.kwargs.window_size': 'calibrated' is only available for n_sink"),
    (("models", "qwen2.5-0.5b", "evaluate"), "yes", "config: key 'models.qwen2.5-0.5b.evaluate': expected boolean, got str 'yes'"),
    (("calibration", "sink_threshold"), 1.5, "config: key 'calibration.sink_threshold': 1.5 must be < 1"),
    (("throughput", "new_tokens"), 0, "config: key 'throughput.new_tokens': 0 must be >= 1"),
    (("report", "sparse_reads", "nsa", "compress_stride"), 64,
     "preset 'default': key 'report.sparse_reads.nsa.compress_stride': 64 exceeds compress_block 32 (blocks would skip tokens); use at most the block"),
    (("report", "sparse_reads", "moba", "top_k"), 0, "config: key 'report.sparse_reads.moba.top_k': 0 must be >= 1"),
    (("report", "sparse_reads", "nsa", "stride"), 16,
     "config: unknown key 'stride' under 'report.sparse_reads.nsa'; allowed: compress_block, compress_stride, select_block, select_blocks, window"),
    (("report", "crossover", "kv_schemes"), ["bf16", "int4"],
     "preset 'default': key 'report.crossover.kv_schemes[1]': bad scheme 'int4'; accepted forms: 'bf16', 'fp8', 'int<bits>-g<group>-r<residual>'"),
    (("report", "crossover", "weight_bits"), [64], "config: key 'report.crossover.weight_bits[0]': 64 must be <= 32"),
    (("colour",), "blue", "config: unknown key 'colour' at top level; allowed:"),
    (("preset",), "fast", "config: key 'preset': unknown preset 'fast'; allowed: default, study, wide, smoke, workload, traffic, "
                          "serving, serving_vllm, evidence, ruler, full, long"),
    (("presets", "smoke", "budgets"), [2], "preset 'smoke': key 'budgets[0]': 2 must be <= 1"),
]


@pytest.mark.parametrize("path,value,message", BAD, ids=[".".join(b[0]) + "=" + repr(b[1])[:20] for b in BAD])
def test_bad_config_gives_one_line(config, path, value, message):
    with pytest.raises(ConfigError) as info:
        resolve(edit(copy.deepcopy(config), path, value), SCHEMA)
    text = str(info.value)
    assert "\n" not in text
    assert message in text


@pytest.mark.slow
def test_snakemake_stops_before_any_job_with_the_line(tmp_path, config):
    bad = edit(copy.deepcopy(config), ("budgets",), [1.5])
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "-n", "--configfile", str(tmp_path / "bad.yaml"), "--directory", str(tmp_path),
         "--snakefile", str(ROOT / "Snakefile")],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode != 0
    assert "kvlab config: key 'budgets[0]': 1.5 must be <= 1" in proc.stderr + proc.stdout
    assert not (tmp_path / "results").exists()


def test_wrapper_names_read_from_sources_match_kvpress_classes():
    """Config reads kvpress's sources (importing it takes seconds); the wrappers found must be exactly the exported
    press classes with a dataclass field `press`."""
    import dataclasses

    import kvpress

    from kvlab.methods.press_source import kvpress_wrapper_names

    classes = {n: getattr(kvpress, n) for n in dir(kvpress) if n.endswith("Press")}
    runtime = {n for n, c in classes.items() if dataclasses.is_dataclass(c) and "press" in {f.name for f in dataclasses.fields(c)}}
    assert kvpress_wrapper_names() == runtime and {"KeyRerotationPress", "MergingPress", "AdaKVPress"} <= runtime


def test_press_fields_read_from_sources_match_dataclass_fields():
    """press_source reads kvpress's sources (no import); its init fields must be dataclasses.fields(init=True) of
    every exported press, and the literal defaults the runtime defaults."""
    import dataclasses

    import kvpress

    from kvlab.methods.press_source import NO_DEFAULT, init_fields

    for name in (n for n in dir(kvpress) if n.endswith("Press")):
        cls = getattr(kvpress, name)
        runtime = {f.name: f for f in dataclasses.fields(cls) if f.init}
        found = init_fields(name)
        assert set(found) == set(runtime), name
        for field, spec in found.items():
            if spec.default is not NO_DEFAULT:
                assert spec.default == runtime[field].default, (name, field)


YAML_BAD = [
    ("budgets: [0.5]\nthreads: 2\nbudgets: [0.25]\n", False,
     "{f}:3:1: duplicate key 'budgets' (first at line 1); YAML would keep only the last silently — keep one"),
    ("methods:\n  full: {kind: full}\n  snapkv:\n    kind: kvpress\n    press: SnapKVPress\n    kind: full\n", False,
     "{f}:6:5: duplicate key 'methods.snapkv.kind' (first at line 4)"),
    ("budgets: [0.5, 0.25\nthreads: 2\n", False,
     "{f}:2:8: YAML syntax error: while parsing a flow sequence (from line 1, column 10): expected ',' or ']', but got ':'; fix the file there"),
    ("models:\n  tiny: {source: tiny\n", False, "{f}:3:1: YAML syntax error: while parsing a flow mapping (from line 2, column 9)"),
    ("budgets:\n\t- 0.5\n", False, "{f}:2:1: YAML syntax error: "),
    ("methods:\n  snapkv: null\n", True,
     "{f}:2:3: key 'methods.snapkv' is null: a --configfile merges into config.yaml key by key and cannot delete a key"),
]


@pytest.mark.parametrize("text,overlay,message", YAML_BAD, ids=range(len(YAML_BAD)))
def test_config_files_are_read_strictly(tmp_path, text, overlay, message):
    from kvlab.state.config import check_config_files

    f = tmp_path / "c.yaml"
    f.write_text(text)
    base = tmp_path / "config.yaml"
    base.write_text("threads: 2\n")
    with pytest.raises(ConfigError) as info:
        check_config_files(base if overlay else f, [f] if overlay else [])
    assert "\n" not in str(info.value)
    assert str(info.value).startswith(message.format(f=f))


def test_null_is_fine_in_the_base_file_and_a_good_overlay_passes(tmp_path):
    from kvlab.state.config import check_config_files

    null = "methods:\n  x: null\n"
    (tmp_path / "config.yaml").write_text(null)
    (tmp_path / "o.yaml").write_text("methods:\n  x: {kind: full}\n")
    (tmp_path / "n.yaml").write_text(null)
    check_config_files(tmp_path / "config.yaml", [tmp_path / "o.yaml"])  # the schema words what null means there
    check_config_files(tmp_path / "absent.yaml", [tmp_path / "o.yaml"])  # no base: the overlay is the config,
    check_config_files(tmp_path / "absent.yaml", [tmp_path / "n.yaml"])  # so a null in it is a base's null
    # the same null as an overlay of that base is refused: the files above pass for where the null is, not unread
    with pytest.raises(ConfigError, match=f"^{re.escape(str(tmp_path / 'n.yaml'))}:2:3: key 'methods.x' is null: "):
        check_config_files(tmp_path / "config.yaml", [tmp_path / "n.yaml"])


@pytest.mark.parametrize("text,message", [
    ("budgets: [0.5]\nbudgets: [0.25]\n", "kvlab config: {f}:2:1: duplicate key 'budgets' (first at line 1)"),
    ("methods:\n  snapkv: null\n", "kvlab config: {f}:2:3: key 'methods.snapkv' is null"),
])
@pytest.mark.slow
def test_snakemake_refuses_a_configfile_it_would_misread(tmp_path, text, message):
    """Snakemake loads --configfile itself (keeping the last duplicate); the Snakefile re-reads the files it loaded
    (workflow.config_settings.configfiles, and config.yaml) strictly before any rule is defined."""
    import shutil

    shutil.copy(ROOT / "config.yaml", tmp_path / "config.yaml")
    (tmp_path / "over.yaml").write_text(text)
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "-n", "--configfile", str(tmp_path / "over.yaml"), "--directory", str(tmp_path),
         "--snakefile", str(ROOT / "Snakefile")],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode != 0
    assert message.format(f=tmp_path / "over.yaml") in proc.stderr + proc.stdout


@pytest.mark.parametrize("text,what", [("", "empty"), ("# nothing but a comment\n", "empty"), ("- models\n- tasks\n", "a list"),
                                       ("just words\n", "the single value 'just words'")])
def test_a_config_that_is_not_a_mapping_gets_one_line(tmp_path, text, what):
    from kvlab.state.config import check_config_files

    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        check_config_files(path)
    assert "\n" not in str(info.value) and str(info.value).startswith(f"{path}: the config is {what}; it must be a mapping")


@pytest.mark.slow
def test_an_empty_config_stops_snakemake_with_kvlab_s_line(tmp_path):
    """Run as a user would: Snakemake stops before any job with kvlab's line, not its own parse error."""
    from conftest import snakemake, workflow_copy

    work = workflow_copy(tmp_path / "w")
    (work / "config.yaml").write_text("")
    proc = snakemake(work, "-n", "results/report.html")
    assert proc.returncode != 0 and "the config is empty; it must be a mapping" in proc.stderr + proc.stdout


@pytest.mark.slow
def test_device_cuda_without_a_gpu_stops_a_local_run_before_any_job(tmp_path):
    """A local run with device: cuda on a machine without one stops with kvlab's line and runs nothing; a dry run
    (planning a cluster submission from a login node) still plans."""
    import torch

    from conftest import snakemake, workflow_copy

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    work = workflow_copy(tmp_path / "w")
    proc = snakemake(work, "results/report.html", "--config", "preset=smoke", "device=cuda")
    out = proc.stderr + proc.stdout
    assert proc.returncode != 0 and "key 'device': 'cuda', but torch sees no CUDA device" in out and "device: cpu" in out
    assert not (work / "results").exists() and not (work / "resources").exists()
    assert snakemake(work, "-n", "results/report.html", "--config", "preset=smoke", "device=cuda").returncode == 0


def test_a_dataset_file_is_checked_before_any_job(config, tmp_path):
    """The user's file is read when the config is: too few rows for `samples`, or a bad row, is one line naming the
    task's key and the file's row and field."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(f'{{"context": "doc {i}", "question": "q{i}", "answers": ["a"]}}\n' for i in range(3)))
    config["tasks"]["mine"] = {"kind": "dataset", "path": str(rows), "samples": 5}
    with pytest.raises(ConfigError, match=rf"^preset 'default': key 'tasks.mine.samples': 5 exceeds the rows of {rows} \(3\); draw at most 3$"):
        resolve(config, SCHEMA)
    config["tasks"]["mine"]["samples"] = 3
    assert resolve(config, SCHEMA)["tasks"]["mine"]["path"] == str(rows)
    rows.write_text(rows.read_text() + '{"context": "doc", "question": "q", "answers": []}\n')
    with pytest.raises(ConfigError, match=rf"^preset 'default': key 'tasks.mine.path': {rows} row 4: field answers must be a non-empty string"):
        resolve(config, SCHEMA)


def test_a_dtype_floor_this_machine_cannot_measure_is_said_once(config, monkeypatch):
    """An fp32 run where bf16 matmuls are emulated has no second dtype to read its floor in: the run says so once
    before its first job (rules/common.smk), naming the floor's tasks, instead of a warning from each of their jobs."""
    from kvlab.util import hardware

    smoke = resolve({**config, "preset": "smoke"}, SCHEMA)
    monkeypatch.setattr(hardware, "bf16_matmul_native", lambda device: False)
    assert dtype_floor_note(smoke) == ("kvlab: dtype_floor: float32 is the only dtype that runs in hardware here, so the jobs of "
                                       "prose_kl, niah_single measure no dtype noise floor (their dtype_noise_* columns stay empty)")
    assert dtype_floor_note({**smoke, "dtype_floor": {"samples": 0, "tasks": ["prose_kl"]}}) is None
    assert dtype_floor_note({**smoke, "dtype": "bfloat16"}) is None  # read again in float32, which always runs
    monkeypatch.setattr(hardware, "bf16_matmul_native", lambda device: True)
    assert dtype_floor_note(smoke) is None


def test_the_command_line_prints_usage_and_one_line_errors(capsys, tmp_path):
    """python -m kvlab.state.config: --help prints its usage; a missing file or an unknown preset is one line, no traceback."""
    from kvlab.state.config import main

    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("usage: python -m kvlab.state.config [-h] [--expand PRESET] [FILE ...]")
    for argv, message in ((["nope.yaml"], "kvlab config: nope.yaml: No such file or directory"),
                          (["--expand", "nope", str(ROOT / "config.yaml")], "kvlab config: config: key 'preset': unknown preset 'nope';")):
        with pytest.raises(SystemExit) as done:
            main(argv)
        assert str(done.value.code).startswith(message) and "\n" not in str(done.value.code)
    main([str(ROOT / "config.yaml")])
    assert capsys.readouterr().out == "1 file(s) read: no duplicate keys, no syntax errors\n"
