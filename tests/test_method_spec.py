"""A config method entry becomes a typed `Method` once: its kind object is built there, travels to the job in the
rule's params (pickled, as Snakemake hands them over) and is shared by the method's variants, so the engine, the
byte accounting and the codecs read that one object and a job builds no kind."""

import pickle
from pathlib import Path

import pytest
import yaml

from kvlab.state.config import resolve
from kvlab.state.jobs import run_params
from kvlab.methods import KINDS, Method, build, variants
from kvlab.methods.base import MethodKind

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def config() -> dict:
    return resolve(yaml.safe_load((ROOT / "config.yaml").read_text()), ROOT / "workflow" / "config.schema.yaml")


def test_kinds_are_built_once_and_a_job_builds_none(config, monkeypatch):
    built = []
    for kind in KINDS.values():
        monkeypatch.setattr(kind, "__init__", lambda self, params, _init=kind.__init__: built.append(1) or _init(self, params))
    methods = build(config["methods"])
    assert len(built) == len(config["methods"])
    run = pickle.loads(pickle.dumps(run_params(config, methods, "niah_single")))  # what a job unpickles
    grid = variants(run["methods"], run["budgets"], "niah_single")
    assert len(built) == len(config["methods"])  # unpickling and expanding the grid build no kind
    for v in grid:
        assert v.impl is run["methods"][v.method].kind and isinstance(v.impl, MethodKind)
    evicting = [m for m in run["methods"].values() if m.evicts]
    assert evicting and all(len({id(v.impl) for v in grid if v.method == m.name}) == 1 for m in evicting)


def test_a_method_reads_as_its_entry_so_snakemake_sees_the_same_params(config):
    """Snakemake compares a job's params by repr: typed methods must print as the plain entries did."""
    run = run_params(config, build(config["methods"]), "prose_kl")
    plain = {name: entry for name, entry in config["methods"].items() if name in run["methods"]}
    assert repr(run["methods"]) == repr(plain)
    assert "tasks" in config["methods"]["mikv2"] and run["methods"]["mikv2"].tasks == config["methods"]["mikv2"]["tasks"]
    assert set(run_params(config, build(config["methods"]), "niah_single")["methods"]) > {"mikv2"}
    assert "mikv2" not in run_params(config, build(config["methods"]), "variable_tracking")["methods"]


def test_bits_reach_the_codec_and_the_byte_layout_from_one_object():
    """kivi's `bits` is read into its scheme once; the layer's codecs and the accounting's layouts come from it."""
    method = Method("kivi2", {"kind": "quant", "scheme": "kivi", "bits": 2, "group": 32, "residual": 32,
                              "key_axis": "channel", "value_axis": "token"})
    scheme = method.kind.scheme
    assert scheme.bits == 2 and scheme.group == 32 and scheme.residual == 32
    spec = scheme.layer_spec(0, 2, 64)
    key, value = method.kind.layouts(64)
    assert spec.key.bits == spec.value.bits == key.bits == value.bits == 2
    assert method.kind.storage["bits"] == 2
    fp8 = Method("fp8", {"kind": "quant", "scheme": "fp8", "bits": 4, "scales": "dynamic"})  # the schema's bits default
    assert fp8.kind.scheme.bits == 8 and fp8.kind.storage["bits"] == 8
