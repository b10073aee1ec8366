"""Presets as overlays, and tasks picked from the catalogue: how config.yaml's layers make one effective config
(kvlab.state.config validates it). Nothing here reads the schema."""

from __future__ import annotations

import copy


class ConfigError(ValueError):
    """A config problem, described in one line."""


CATALOG = "task_catalog"  # the top-level key holding every task definition once; `tasks` picks from it by name


OVERLAY = ("extends", "replace", "methods_add", "methods_drop", "methods_tasks")  # a preset's own keys (not config keys)


def with_preset(config: dict, name: str) -> dict:
    """A copy of `config` without its presets, preset `name` laid over it, and `preset` set to `name`. Not
    validated: see `resolve`.

    A preset is an overlay. It starts from preset `extends` (default: preset `default`, the top-level config with
    whatever `presets.default` changes);
    `methods_drop` (names) removes methods, `methods_add` (name: spec) adds new ones, `methods_tasks` (name: tasks,
    or `all` for every task) sets a method's `tasks`; every other key is merged into the config key by key (mappings
    recursively; a list or a value replaces), except the keys named in `replace`, whose value replaces the config's
    whole. Then each entry of `tasks` is made whole from `task_catalog` (select_tasks), which is dropped: after every
    overlay, so a preset's `tasks: {niah_single: {samples: 4}}` changes whatever its base picked. A name that does not
    exist where it must, or exists where it must not, is one ConfigError line."""
    presets = config.get("presets") or {}
    out = copy.deepcopy({k: v for k, v in config.items() if k != "presets"})
    chain, at = [], name
    while at != "default":
        if at not in presets:
            where = f"preset '{chain[-1]}': key 'extends'" if chain else "config: key 'preset'"
            raise ConfigError(f"{where}: unknown preset '{at}'; allowed: " + ", ".join(dict.fromkeys(["default", *presets])))
        if at in chain:
            raise ConfigError(f"preset '{name}': presets extend each other in a circle ({' → '.join([*chain, at])}); "
                              "one of them must extend default")
        chain.append(at)
        at = (presets[at] or {}).get("extends", "default")
    for each in ["default", *reversed(chain)]:  # preset default, if the config gives one, lies under every other
        out = overlay(out, presets.get(each) or {}, f"preset '{each}'")
    select_tasks(out, f"preset '{name}'")
    out.pop(CATALOG, None)
    out["preset"] = name
    return out


def select_tasks(config: dict, where: str) -> None:
    """Make each entry of `config`'s `tasks` whole, in place, from its `task_catalog` (a mapping of task name to
    definition: `kind` and that kind's keys). An entry that gives `kind` is a task of its own, whole as written. Any
    other picks the catalogue's entry of its name, or of its `from` (a task named apart from its definition), and its
    other keys are laid over that entry as a preset's are over the config (mappings key by key): a key it changes
    keeps the catalogue's place, a new key follows them (job params are compared by their printed form, order
    included). `tasks: {niah_single: {}}` is the catalogue's niah_single as it stands."""
    catalog, entries = config.get(CATALOG, {}), config.get("tasks")
    if not isinstance(entries, dict) or not isinstance(catalog, dict):
        return  # the schema words it
    for name, entry in entries.items():
        if not isinstance(entry, dict) or "kind" in entry:
            continue
        source = entry.get("from", name)
        if not isinstance(source, str) or source not in catalog:
            key, what = (f"tasks.{name}.from", repr(source)) if "from" in entry else (f"tasks.{name}", f"'{name}'")
            raise ConfigError(f"{where}: key '{key}': no task {what} in {CATALOG} ({', '.join(catalog) or 'empty'}); "
                              "pick one by name (or by `from`), or give `kind` for a task of its own")
        entries[name] = _merged(copy.deepcopy(catalog[source]), {k: v for k, v in entry.items() if k != "from"})


def overlay(config: dict, preset: dict, where: str) -> dict:
    """`preset`'s changes applied to a copy of `config` (see with_preset)."""
    out = copy.deepcopy(config)
    replace = preset.get("replace", [])
    if not isinstance(replace, list) or any(key not in preset or key in OVERLAY for key in replace):
        raise ConfigError(f"{where}: key 'replace': {replace!r}; it must list config keys this preset sets, whose "
                          "values then replace the config's whole")
    for key, value in preset.items():
        if key not in OVERLAY:
            out[key] = copy.deepcopy(value) if key in replace else _merged(out.get(key), value)
    methods = out.setdefault("methods", {})
    for m in _names(preset, "methods_drop", where):
        if m not in methods:
            raise ConfigError(f"{where}: key 'methods_drop': no method '{m}' to drop; methods here: {', '.join(methods)}")
        del methods[m]
    for m, spec in _mapping(preset, "methods_add", where).items():
        if m in methods:
            raise ConfigError(f"{where}: key 'methods_add.{m}': method '{m}' exists already; change its tasks with "
                              "methods_tasks, or drop it first with methods_drop")
        methods[m] = copy.deepcopy(spec)
    for m, each in _mapping(preset, "methods_tasks", where).items():
        if m not in methods:
            raise ConfigError(f"{where}: key 'methods_tasks.{m}': no method '{m}'; methods here: {', '.join(methods)}")
        if each == "all":
            methods[m].pop("tasks", None)
        else:
            methods[m]["tasks"] = copy.deepcopy(each)
    return out


def _merged(base, change):
    """`change` merged into `base`: mappings key by key, recursively; anything else replaces."""
    if not (isinstance(base, dict) and isinstance(change, dict)):
        return copy.deepcopy(change)
    return {**base, **{k: _merged(base.get(k), v) for k, v in change.items()}}


def _names(preset: dict, key: str, where: str) -> list:
    value = preset.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where}: key '{key}': {value!r}; it must be a list of method names")
    return value


def _mapping(preset: dict, key: str, where: str) -> dict:
    value = preset.get(key, {})
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: key '{key}': {value!r}; it must map method names to "
                          + ("their specs" if key == "methods_add" else "a list of tasks, or all"))
    return value
