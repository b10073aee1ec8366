"""The memory model: what one evaluation sample holds at its peak, per phase, and the waves that keep it under a budget.

    python -m kvlab.state.memory --model NAME|config.json --context N [--preset P] [--task T] [--device-gb G] [--dtype D]

An evaluation job holds, over its loaded model (one sample at a time past 8K tokens; `samples_at_once`):

- prefill: the prompt's K/V and each attention layer's captured input (what a press's `compress` reads), once per
  compression (the context alone, and context + question for the aware modes), plus one layer's activations of the
  pass being run;
- references: the full cache's answers of every compression decoded as one batch (its caches stacked);
- waves: the variants of a wave compressed together (their stored caches), then read in teacher-forced batches (a
  dense row padded in its batch, a quantized row's full-precision view); the rows that leave the full answer are
  decoded from the same caches.

Each term is a count of tensor elements from the model's shape (config.json) times the compute dtype's bytes, times a
factor for what the allocator and the kernels' temporaries add on top (`FACTORS`), fitted to peak RSS over the
loaded model measured on a CPU (benchmarks/long_memory.py, rows in results/benchmarks/long_memory.parquet). The engine
plans each sample's waves with `job_waves` under the job's `memory.budget_gb`; `python -m kvlab.state.memory` prints the
same estimate before a run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GB = 1e9

# Allocator and kernel overhead over the counted tensors, per phase: peak RSS over the loaded model / counted bytes.
# Fitted on Qwen2.5-0.5B in bf16 on the 2-core AMX Xeon, one niah_single sample with the `long` methods in one wave
# (benchmarks/long_memory.py): the wave phase holds the peak, at 1.86x, 1.93x and 1.94x its count at 4K, 8K and 16K
# (what the count leaves out: each phase's temporaries, which the heap keeps, fragmented, for reuse); the references
# phase read 1.55x at 16K (engine phases timed apart); prefill within its count. The 32K rows and the budgeted rows
# check the fit (docs/memory.md). On a GPU the caching allocator differs: unchecked until one is lent (gpu/check.sh).
FACTORS = {"prefill": 1.0, "references": 1.55, "wave": 1.9}
# A loaded job beyond its weights' bytes on a CPU: torch, the tokenizer and the packed linear layers' buffers (peak RSS
# of a loaded Qwen2.5-0.5B in bf16, 2.65 GB, less its 1.26 GB of weights; benchmarks/long_memory.py's loaded_gb). A
# GPU's CUDA context sits outside torch's allocated bytes, which the budget counts there.
RUNTIME = {"cpu": 1.4 * 1e9, "cuda": 0.0}
ACTIVATION_COPIES = 3  # one layer's MLP intermediates (gate, up, their product) live at once in a prefill
VIEW_ROOM = 1.5  # a quantized row's full-precision view: its tokens plus half again of room (kvcache._viewed)

# The article's models (their config.json facts), for sizing a run before the weights are at hand.
ARTICLE_MODELS = {
    "llama3.1-8b": {"num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
                    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "tie_word_embeddings": False,
                    "max_position_embeddings": 131072},
    "qwen2.5-7b": {"num_hidden_layers": 28, "hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28,
                   "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 152064, "tie_word_embeddings": False,
                   "max_position_embeddings": 131072},
}


class MemoryBudgetError(ValueError):
    """A job whose one variant does not fit its memory budget (raised before any work)."""


@dataclass(frozen=True)
class Shape:
    """What the memory model reads of a model's config.json."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    sliding_layers: int = 0
    window: int = 0
    max_context: int = 0

    @classmethod
    def from_config(cls, config: dict) -> "Shape":
        config = config.get("text_config", config)
        heads = config["num_attention_heads"]
        types = config.get("layer_types") or []
        return cls(config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"], heads,
                   config.get("num_key_value_heads", heads), config.get("head_dim") or config["hidden_size"] // heads,
                   config["vocab_size"], bool(config.get("tie_word_embeddings", False)),
                   sum(t == "sliding_attention" for t in types), config.get("sliding_window") or 0,
                   config.get("max_position_embeddings", 0))

    @property
    def params(self) -> int:
        """Weights: embeddings (twice unless tied), attention and MLP projections, norms."""
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        layer = attention + 3 * self.hidden * self.intermediate + 2 * self.hidden
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.layers * layer + self.hidden

    def kv(self, tokens: int, nbytes: int) -> int:
        """Bytes of a full cache of `tokens` (sliding-window layers hold their window at most)."""
        held = (self.layers - self.sliding_layers) * tokens + self.sliding_layers * min(tokens, self.window or tokens)
        return 2 * held * self.kv_heads * self.head_dim * nbytes


def model_shape(model: str, models_dir: str | Path = "resources/models") -> Shape:
    """A model's shape: an article model by name (`ARTICLE_MODELS`), an acquired model's name (its config.json under
    `models_dir`), or a config.json path."""
    if model in ARTICLE_MODELS:
        return Shape.from_config(ARTICLE_MODELS[model])
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        path = Path(models_dir) / model / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"--model {model}: not an article model ({', '.join(ARTICLE_MODELS)}), an acquired model "
                                f"({path} is missing: run the acquire rule first) or a config.json path")
    return Shape.from_config(json.loads(path.read_text()))


@dataclass(frozen=True)
class Row:
    """What the model needs to know of one variant: the share of the context it keeps and the bits it stores them in
    (None: the compute dtype's), and whether its rows are read quantized."""

    keep: float
    bits: int | None

    @classmethod
    def of(cls, variant) -> "Row":
        return cls(float(variant.budget), variant.storage.get("bits") if variant.impl.quantized else None)


@dataclass
class Estimate:
    """Peak bytes over the loaded model per phase, the waves, and the least budget that fits."""

    phases: dict[str, float]
    waves: list[list[int]]
    least: float  # the smallest budget it fits: the full cache and one variant a wave

    @property
    def peak(self) -> float:
        return max(self.phases.values())


def _variant_bytes(shape: Shape, nbytes: int, tokens: int, row: Row, path: int) -> tuple[float, float]:
    """(stored, read): a variant's stored cache, and what reading it in a teacher-forced batch adds (a dense row: its
    padded copy in the batch; a quantized row: its full-precision view) with its logits along a `path`-token answer."""
    full = shape.kv(tokens, nbytes) * row.keep
    stored = full if row.bits is None else full * row.bits / (8 * nbytes)
    read = full * (1 if row.bits is None else VIEW_ROOM) + 2 * path * shape.vocab * 4
    return stored, read


def estimate(shape: Shape, dtype: str, tokens: int, rows: list[Row], ref: int, compressions: int = 2, path: int = 32,
             budget: float | None = None, samples: int = 1) -> Estimate:
    """The peak of one `tokens` sample with these variants (`rows`; `ref` the full cache's index) and `compressions`
    prefills (2 with the aware modes), in waves that fit `budget` bytes over the loaded model (None: one wave), with
    `samples` evaluated together (their prefills all held: `samples_at_once`). Raises MemoryBudgetError when
    a wave of the reference and one variant does not fit."""
    b = DTYPE_BYTES[dtype]
    kv, captures = shape.kv(tokens, b), shape.layers * tokens * shape.hidden * b
    # every prefill's K/V; the context's captured layer inputs once (a question-aware prefill holds its own tokens'
    # alone: `Prefilled.capture`), kept until the variants are compressed
    held = samples * (compressions * kv + captures)
    activations = ACTIVATION_COPIES * tokens * (shape.intermediate + shape.hidden) * b
    phases = {"prefill": FACTORS["prefill"] * (held + activations),
              "references": FACTORS["references"] * (held + samples * compressions * kv)}
    costs = [_variant_bytes(shape, b, tokens, r, path) for r in rows]
    costs[ref] = (0.0, costs[ref][1])  # the full cache's copy shares the prefill's tensors
    # a wave's rows that leave the full answer are decoded from its own caches (with several waves, before the next)

    def wave_peak(wave: list[int]) -> float:  # dense rows are read in one batch, quantized ones in another
        read = max(sum(costs[i][1] for i in wave if (rows[i].bits is None) == dense) for dense in (True, False))
        return FACTORS["wave"] * (held + sum(costs[i][0] for i in wave) + read)

    order = [i for i in range(len(rows)) if i != ref]
    least = max(phases["prefill"], phases["references"], *(wave_peak([ref, i]) for i in order or [ref]))
    if budget is not None and least > budget:
        raise MemoryBudgetError(f"a {tokens}-token sample needs at least {least / GB:.1f} GB beside the model (the full "
                                f"cache and one variant a wave) but the budget leaves {budget / GB:.1f} GB; raise "
                                "memory.budget_gb or shorten context_tokens")
    if budget is None:
        waves = [sorted([ref, *order])]
    else:
        waves, wave = [], [ref]
        for i in order:
            if len(wave) > 1 and wave_peak([*wave, i]) > budget:
                waves.append(sorted(wave))
                wave = [ref]
            wave.append(i)
        waves.append(sorted(wave))
    phases["wave"] = max(wave_peak(w) for w in waves)
    return Estimate(phases, waves, least)


def samples_at_once(context_tokens: int) -> int:
    """Samples an evaluation job evaluates together (their full-cache answers decoded as one batch): as many as hold 8K
    context tokens, so that their prefills' captured attention inputs (kept until every variant is compressed) stay
    within a few GB. The memory model counts their prefills as held together."""
    return max(1, 8192 // context_tokens)


def available_bytes(device: str, cgroup: Path = Path("/sys/fs/cgroup"), meminfo: Path = Path("/proc/meminfo")) -> int:
    """Memory free for a job now: on a CPU, MemAvailable (Linux), or less where the job's cgroup (v2) limits it (a
    SLURM job's --mem: its memory.max less its memory.current); free device memory on a GPU."""
    if device == "cuda":
        import torch

        return torch.cuda.mem_get_info()[0]
    free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            free = int(line.split()[1]) * 1024
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            free = min(free, int(limit) - int((cgroup / "memory.current").read_text()))
    except (OSError, ValueError):
        pass  # no cgroup v2 memory controller here: the machine's memory
    return free


def budget_bytes(memory: dict, device: str) -> float:
    """The job's budget: memory.budget_gb, or memory.share of what is free when the job starts."""
    if memory.get("budget_gb"):
        return memory["budget_gb"] * GB
    return memory.get("share", 0.8) * available_bytes(device)


@dataclass
class Waves:
    """The engine's `waves` (kvlab.engine.sample): each compression's variants in waves whose estimate fits `budget`
    bytes over the loaded model; `planned`: the job's estimate at its longest prompt (`job_waves`)."""

    shape: Shape
    dtype: str
    budget: float
    compressions: int
    path: int
    samples: int = 1
    planned: Estimate | None = None

    def __call__(self, variants, ref: int, tokens: int) -> list[list[int]]:
        return estimate(self.shape, self.dtype, tokens, [Row.of(v) for v in variants], ref, self.compressions, self.path,
                        self.budget, self.samples).waves


def footprint(device: str) -> int:
    """What the job holds now (its loaded model): resident bytes on a CPU, allocated device memory on a GPU."""
    if device == "cuda":
        import torch

        return torch.cuda.memory_allocated()
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def job_waves(model, run: dict, grid: list, tokens: int, cap: int, floor: bool, samples: int = 1):
    """An evaluation job's `waves` under its budget (run["memory"]: `budget_bytes`), checked before any work against
    its longest prompt (`tokens`): the budget less what the loaded model holds now, less the dtype floor's fp32 copy
    (`floor`) to come. A budget too small for the full cache and one variant raises MemoryBudgetError (one line: what
    the job needs, what it got)."""
    import logging

    budget = budget_bytes(run.get("memory", {}), run["device"])
    shape = Shape.from_config(model.config.to_dict())
    loaded = footprint(run["device"]) + (shape.params * 4 if floor else 0)
    compressions = 1 + any(m in ("aware", "multi_turn") for m in run["question_modes"])
    ref = next(i for i, v in enumerate(grid) if v.kind == "full")
    try:
        est = estimate(shape, run["dtype"], tokens, [Row.of(v) for v in grid], ref, compressions, cap + 1,
                       budget - loaded, samples)
    except MemoryBudgetError as e:
        raise MemoryBudgetError(f"memory budget {budget / GB:.1f} GB ({loaded / GB:.1f} GB of it the loaded model"
                                f"{' and the dtype floor' if floor else ''}): {e}") from None
    logging.getLogger(__name__).info("memory: budget %.1f GB, %.1f GB loaded; at %d tokens, peak %.1f GB more, in %d "
                                     "wave(s)", budget / GB, loaded / GB, tokens, est.peak / GB, len(est.waves))
    return Waves(shape, run["dtype"], budget - loaded, compressions, cap + 1, samples, est)


@dataclass
class Job:
    """What the model needs to know of one evaluation job of a preset: its variants, the reference's index, the
    prefills its question modes need, the tokens teacher-forced along an answer, and the samples run together."""

    task: str
    rows: list[Row]
    ref: int
    compressions: int
    path: int

    def estimate(self, shape: Shape, dtype: str, tokens: int, budget: float | None) -> Estimate:
        return estimate(shape, dtype, tokens, self.rows, self.ref, self.compressions, self.path, budget,
                        samples_at_once(tokens))


def preset_jobs(preset: str | None, task: str | None, config_path: str) -> list[Job]:
    """The evaluation jobs of a preset (or its one `task`), as the memory model reads them: a task whose kind
    teacher-forces a reference text (prose continuation: kvlab.tasks.reference_tokens) prefills its document alone;
    the other tasks prefill the question-aware prompt too where a question mode needs it, and teacher-force the full
    cache's answer (at most their decoding cap, kvlab.tasks.max_new_tokens)."""
    import yaml

    from kvlab.state.config import resolve
    from kvlab.methods import build, variants
    from kvlab.tasks import max_new_tokens, reference_tokens

    config = yaml.safe_load(Path(config_path).read_text())
    if preset:
        config["preset"] = preset
    config = resolve(config, Path(config_path).parent / "workflow" / "config.schema.yaml")
    if task and task not in config["tasks"]:
        raise SystemExit(f"--task {task}: not a task of preset {preset or 'default'} ({', '.join(config['tasks'])})")
    methods, aware = build(config["methods"]), any(m in ("aware", "multi_turn") for m in config["question_modes"])
    jobs = []
    for name in [task] if task else list(config["tasks"]):
        spec, grid = config["tasks"][name], variants(methods, config["budgets"], name)
        reference = reference_tokens(spec)  # prose: no question, its reference text teacher-forced
        path = reference or max_new_tokens(spec, config["max_new_tokens"]) + 1
        jobs.append(Job(name, [Row.of(v) for v in grid], next(i for i, v in enumerate(grid) if v.kind == "full"),
                        1 if reference else 1 + aware, path))
    return jobs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvlab.state.memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help=f"an acquired model's name, a config.json, or one of {', '.join(ARTICLE_MODELS)}")
    parser.add_argument("--context", type=int, required=True, help="prompt tokens of one sample")
    parser.add_argument("--preset", help="the config preset whose jobs run (default: the config's own)")
    parser.add_argument("--task", help="one task of the preset (default: each of its tasks)")
    parser.add_argument("--config", default="config.yaml")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES))
    parser.add_argument("--device", default="cuda", choices=sorted(RUNTIME), help="where the job runs (default: cuda)")
    parser.add_argument("--device-gb", type=float, help="memory the job may use, weights included (default: free now)")
    args = parser.parse_args(argv)
    shape = model_shape(args.model)
    if not args.device_gb and args.device == "cuda":
        parser.error("--device-gb: the GPU's memory in GB (e.g. 80 for an H100, 141 for an H200)")
    total = args.device_gb * GB if args.device_gb else available_bytes("cpu")
    weights = shape.params * DTYPE_BYTES[args.dtype] + RUNTIME[args.device]
    print(f"{args.model} at {args.context} tokens in {args.dtype} on {args.device}, preset {args.preset or 'default'}: "
          f"loaded model {weights / GB:.2f} GB of {total / GB:.1f} GB; per job, GB over the loaded model:")
    every = True
    for job in preset_jobs(args.preset, args.task, args.config):
        est = job.estimate(shape, args.dtype, args.context, None)
        phases = ", ".join(f"{phase} {size / GB:.2f}" for phase, size in est.phases.items())
        try:
            waves = job.estimate(shape, args.dtype, args.context, total - weights).waves
            verdict = f"fits in {len(waves)} wave(s) of {', '.join(str(len(w)) for w in waves)} variants"
        except MemoryBudgetError:
            every, verdict = False, f"does not fit: needs at least {(weights + est.least) / GB:.1f} GB"
        print(f"  {job.task}: {len(job.rows)} variants, one wave: {phases}; peak {(weights + est.peak) / GB:.1f} GB; "
              f"{verdict}")
    return 0 if every else 1


if __name__ == "__main__":
    sys.exit(main())
