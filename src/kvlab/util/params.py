"""The parameters of method and task kinds, declared once, and the config schema's entries made from them.

A kind declares its parameters as a dataclass (``@dataclass(kw_only=True)``, named `Params`) whose fields are
`param`s: the annotation gives the JSON type (int, float, str, bool, dict, list[...], a Literal of the values
allowed, ``X | None`` for a key that may be left out without a default), the default is the schema's default (none:
the key is required), the doc its description, and keyword arguments add the JSON-schema keywords the type cannot
say (``minimum=1``, ``pattern=...``, ``items={...}``). A class variable `SCHEMA` adds keywords of the whole entry
(e.g. ``oneOf``). `definition` turns a registry of kinds into the schema of a config entry: its `kind` one of them,
and one if/then branch per kind allowing exactly that kind's keys; kvlab.state.config fills `$defs.method` and
`$defs.task` of workflow/config.schema.yaml with it each time it loads the schema, so nothing is generated into
a file.
"""

from __future__ import annotations

import copy
import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal

JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", dict: "object", list: "array"}


def param(default: Any = dataclasses.MISSING, doc: str = "", **schema) -> Any:
    """A dataclass field declaring one parameter: its `default` (left out: the key is required; None: optional,
    with no default), its one-line `doc`, and JSON-schema keywords beyond its type (merged into the type's:
    mappings key by key, a list of mappings item by item, anything else replaces; `enum` or `const` drop `type`)."""
    metadata = {"doc": doc, "schema": schema}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def shared(params: type, name: str, doc: str | None = None) -> Any:
    """Parameter `name` as `params` declares it (its doc, or a kind's own `doc`), for a kind that takes it without
    subclassing `params`, or places it elsewhere among its keys (defaults are filled in the order of the keys)."""
    (field,) = [f for f in dataclasses.fields(params) if f.name == name]
    return param(_default(field), field.metadata["doc"] if doc is None else doc, **field.metadata["schema"])


def definition(kinds: Mapping[str, type]) -> dict:
    """The schema of a config entry of these kinds (kind name: its `Params`): `kind` is required and one of them,
    and each kind's branch allows exactly its keys, requires those without a default and fills the defaults."""
    return {
        "type": "object",
        "required": ["kind"],
        "properties": {"kind": {"enum": list(kinds)}},
        "allOf": [{"if": {"properties": {"kind": {"const": kind}}}, "then": branch(params)} for kind, params in kinds.items()],
    }


def branch(params: type) -> dict:
    """The `then` of one kind's branch: its keys (besides `kind`), the required ones, the kind's own `SCHEMA`."""
    hints = typing.get_type_hints(params)
    fields = dataclasses.fields(params)
    out: dict = {"additionalProperties": False}
    required = [f.name for f in fields if _default(f) is dataclasses.MISSING]
    if required:
        out["required"] = required
    out["properties"] = {"kind": {}, **{f.name: field_schema(f, hints[f.name]) for f in fields}}
    return {**out, **copy.deepcopy(getattr(params, "SCHEMA", {}))}


def field_schema(field: dataclasses.Field, hint) -> dict:
    """One parameter's schema: its type's, its keywords, its description and its default."""
    own = field.metadata["schema"]
    out = _merged(type_schema(hint), own)
    if "enum" in own or "const" in own:
        out.pop("type", None)
    if field.metadata["doc"]:
        out["description"] = field.metadata["doc"]
    default = _default(field)
    if default is not None and default is not dataclasses.MISSING:
        out["default"] = default
    return out


def type_schema(hint) -> dict:
    """The JSON schema of a Python annotation (see the module)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return {"const": args[0]} if len(args) == 1 else {"enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        options = [type_schema(a) for a in args if a is not type(None)]
        return options[0] if len(options) == 1 else {"oneOf": options}
    if origin is list:
        return {"type": "array", **({"items": type_schema(args[0])} if args else {})}
    return {"type": JSON_TYPES[origin or hint]}


def _default(field: dataclasses.Field):
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def _merged(base, change):
    if isinstance(base, dict) and isinstance(change, dict):
        return {**base, **{k: _merged(base.get(k), v) for k, v in change.items()}}
    if isinstance(base, list) and isinstance(change, list) and len(base) == len(change) and all(isinstance(c, dict) for c in change):
        return [_merged(b, c) for b, c in zip(base, change)]
    return copy.deepcopy(change)
