"""The plug-in registries (method kinds, quantization schemes, task kinds) agree with the config schema and
the README's "Extending kvlab" guide, and the scheme added through them (lmdeploy) stores what it should."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from kvlab.config import load_schema
from kvlab.kernels import kvcache, layouts
from kvlab.methods import KINDS, Variant, kind_of
from kvlab.methods.schemes import SCHEMES
from kvlab.tasks import GENERATORS
from kvlab.tasks.base import SHAPES

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
    table = set(re.findall(r"^  \| `(\w+)` \|", README, flags=re.M))
    assert set(SCHEMES) <= table, set(SCHEMES) - table


def test_task_kinds_are_the_schema_kinds_with_a_shape_and_a_readme_row():
    task = SCHEMA["$defs"]["task"]
    assert set(GENERATORS) == set(task["properties"]["kind"]["enum"]) == branches(task)
    # niah's shape follows its parameters, ruler's its RULER task and dataset's its entry (Sample.shape); every other
    # kind has one
    assert set(GENERATORS) - {"niah", "ruler", "dataset"} <= set(SHAPES) and not set(SHAPES) - set(GENERATORS)
    rows = {k for line in re.findall(r"^  \| (`[^|]+`) \|", README, flags=re.M) for k in re.findall(r"`(\w+)`", line)}
    assert set(GENERATORS) <= rows, set(GENERATORS) - rows


def test_the_guide_names_the_registries_where_they_are():
    guide = README[README.index("## Extending kvlab"):]
    for registry, path in (("KINDS", "src/kvlab/methods/__init__.py"), ("SCHEMES", "src/kvlab/methods/schemes/__init__.py"),
                           ("KINDS", "src/kvlab/tasks/__init__.py"), ("SHAPES", "src/kvlab/tasks/base.py"),
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
