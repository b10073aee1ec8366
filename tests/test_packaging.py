"""kernels/ is installed as kvlab.kernels, never as a bare `kernels` that would shadow Hugging Face's."""

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from packaging import version
from transformers.utils import import_utils

ROOT = Path(__file__).resolve().parents[1]


def test_kernels_folder_is_kvlab_kernels():
    import kvlab.kernels

    assert Path(kvlab.kernels.__file__).resolve() == ROOT / "kernels" / "__init__.py"
    spec = importlib.util.find_spec("kernels")  # Hugging Face's distribution, if installed; never ours
    assert spec is None or not Path(spec.origin or "").resolve().is_relative_to(ROOT)


def test_transformers_kernels_probe_sees_only_hugging_faces_kernels():
    """transformers asks whether Hugging Face's `kernels` distribution is installed (and recent enough). Our folder
    must not answer: it has no version, and the probe, reading 'N/A', would raise instead of saying False."""
    import kvlab.kernels  # noqa: F401  importable under its own name

    try:
        installed = version.parse(importlib.metadata.version("kernels")) >= version.parse(import_utils.KERNELS_MIN_VERSION)
    except importlib.metadata.PackageNotFoundError:
        installed = False
    assert import_utils.is_kernels_available() is installed


def test_kvlab_asks_for_huge_pages_before_torch_is_imported():
    """PyTorch's CPU allocator reads THP_MEM_ALLOC_ENABLE once, at torch's first allocation: importing kvlab sets it
    (a user's own value wins) and imports no torch itself, so every kvlab module that imports torch comes after."""
    code = "import os, sys, kvlab; print('torch' in sys.modules, os.environ['THP_MEM_ALLOC_ENABLE'])"
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    for given, seen in ((None, "1"), ("0", "0")):
        if given is not None:
            env["THP_MEM_ALLOC_ENABLE"] = given
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
        assert out.split() == ["False", seen]


def test_every_subpackage_is_installed():
    """A regular (non-editable) install ships only the packages pyproject.toml lists: each folder of src/kvlab with an
    __init__.py must be one of them (kvlab.methods.schemes was missing: editable installs hid it)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(("kvlab", *p.parent.relative_to(ROOT / "src" / "kvlab").parts)) for p in (ROOT / "src" / "kvlab").rglob("__init__.py")}
    assert found - listed == set()
    assert "kvlab.kernels" in listed
