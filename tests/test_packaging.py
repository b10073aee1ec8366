"""kernels/ is installed as kvlab.kernels, never as a bare `kernels` that would shadow Hugging Face's."""

import importlib.util
from pathlib import Path

from transformers.utils import import_utils

ROOT = Path(__file__).resolve().parents[1]


def test_kernels_folder_is_kvlab_kernels():
    import kvlab.kernels

    assert Path(kvlab.kernels.__file__).resolve() == ROOT / "kernels" / "__init__.py"
    spec = importlib.util.find_spec("kernels")  # Hugging Face's distribution, if installed; never ours
    assert spec is None or not Path(spec.origin or "").resolve().is_relative_to(ROOT)


def test_transformers_kernels_probe_does_not_break():
    assert import_utils.is_kernels_available() in (True, False)
