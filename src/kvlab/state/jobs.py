"""What a measuring job receives: the rule's params (`run_params`, built from the config by rules/common.smk and by
the command-line tools that run one job, kvlab.tools.bench_eval and kvlab.tools.profile_eval), made concrete on the machine
that runs it (`run_settings`).

Above the engine and the method kinds (the import contract in pyproject.toml): kvlab.util.io stays below them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

from kvlab.methods import Method, for_task, with_calibration
from kvlab.models.card import read_card
from kvlab.state.memory import DTYPE_BYTES

RUN_KEYS = ("budgets", "question_modes", "max_new_tokens", "noise_floor_samples", "dtype", "device")


def run_params(config: dict, methods: Mapping[str, Method], task: str | None = None) -> dict:
    """The evaluation knobs a measuring job receives (threads are added from the job): the typed `methods` (built
    once from config['methods'], kvlab.methods.build) and, with `task`, only those that run on it, so adding a
    method limited to some tasks reruns only those tasks' jobs; the task's rounds (kvlab.state.sequential), decided at
    the report's thresholds; the dtype floor's samples on its tasks only."""
    run = {key: config[key] for key in RUN_KEYS}
    floor = config["dtype_floor"]  # only its tasks' jobs get the key: listing a task reruns that task's jobs alone
    if floor["samples"] and task in floor["tasks"]:
        run["dtype_floor_samples"] = floor["samples"]
        run["dtype_floor_max_tokens"] = floor["max_context_tokens"]
    if task is not None:
        seq, decision = config["sequential"], config["decision"]
        run["sequential"] = {
            "max_samples": config["tasks"][task].get("max_samples", seq["max_samples"]),
            "round": seq["round"],
            "rule": {k: decision[k] for k in ("tolerance_points", "kl_safe", "kl_cap_ratio", "kl_tail_share",
                                              "planned_share")},
        }
        if seq.get("stop_after_minutes"):  # only when set: a run without it keeps its jobs' params (and checkpoints)
            run["sequential"]["stop_after_minutes"] = seq["stop_after_minutes"]
    return {"methods": for_task(methods, task), **run}


def run_settings(smk) -> dict:
    """A measuring job's `run` dict: the rule's params, its threads and memory budget (kvlab.state.memory; the same rows
    under any budget, so changing it reruns nothing), `dtype: auto` resolved on the machine that
    runs the job (kvlab.util.hardware.compute_dtype), and methods with calibrated values filled in from the job's
    calibration input (when it has one)."""
    from kvlab.util.hardware import compute_dtype

    run = dict(smk.params.run, threads=smk.threads, memory=smk.config.get("memory", {}))  # not a param: any budget
    run["dtype"] = compute_dtype(run["dtype"], run["device"])
    calibration = list(smk.input.get("calibration", []))
    if calibration:
        run["methods"] = with_calibration(run["methods"], Path(calibration[0]).parent)
    return run


# An evaluation job's peak host memory as measured (issue 53: peak RSS from Snakemake's benchmark files, 2-core AVX2
# CPU): Qwen2.5-0.5B in fp32, one niah_single sample with the default's 22 variants in both question modes, 9.4 GB
# at 4K context tokens and 15.4 GB at 8K (1.5 GB more per 1K); prose_kl at 1K, 10.2 GB.
MEM_FLOOR_MB = 16000  # what every job of the default preset on Qwen2.5-0.5B up to 4K fits in (prose_kl's 10.2 GB)
MEM_RUNTIME_MB = 1400  # the process less its model and context: 9.4 GB less 2.0 GB of weights less 4K tokens' 6.0 GB
TOKEN_COPIES = 14  # what a context token holds, in its hidden state and K/V per layer: 1.5 MB at 4-8K (110.6 KB each)
MEM_HEADROOM = 1.25  # above the estimate: the measurements' spread, the variants and tasks they did not cover
CUDA_HOST_MB = 8000  # on a GPU the weights, caches and activations sit in device memory (weights load straight there)


def eval_mem_mb(card: dict, dtype: str, device: str, context_tokens: int, dtype_floor: bool = False) -> int:
    """The host memory (MB, SLURM's --mem) to request for an evaluation job of the model `card` (kvlab.models.card)
    at `context_tokens`: on a CPU, the process (MEM_RUNTIME_MB), the weights in `dtype`, a second copy where the job
    measures the dtype floor (fp32 beside a half-precision run; bf16 beside fp32), and TOKEN_COPIES of each context
    token's hidden state and K/V in every layer; MEM_HEADROOM above that, in whole GB, and never below MEM_FLOOR_MB.
    A linear fit to the two measured peaks, scaled by the model's width and depth: the engine's memory grows with
    context × variants without a bound until it keeps a budget (issue 53). On `cuda`, CUDA_HOST_MB whatever the
    model: its weights go from the file to the device (kvlab.steps.evaluate.load_model). `context_tokens` 0 (a dataset's
    natural lengths): MEM_FLOOR_MB."""
    if device == "cuda":
        return CUDA_HOST_MB
    if not context_tokens:
        return MEM_FLOOR_MB
    size = 4 if dtype == "auto" else DTYPE_BYTES[dtype]  # auto: sized for fp32, where bf16 is not native
    weights = card["n_params"] * size
    floor = card["n_params"] * (4 if size == 2 else 2) if dtype_floor else 0
    width = card["num_layers"] * (card["hidden_size"] + 2 * card["num_kv_heads"] * card["head_dim"]) * size
    need = MEM_RUNTIME_MB + (weights + floor + TOKEN_COPIES * width * context_tokens) / 1e6
    return max(MEM_FLOOR_MB, 1000 * math.ceil(MEM_HEADROOM * need / 1000))


def job_mem_mb(config: dict, model_dir: str, task: str, context_tokens: int) -> int:
    """`eval_mem_mb` of an evaluation job as its rule asks (rules/evaluate.smk): the card read from `model_dir`, the
    task's dtype floor from `config`. Until the model is acquired, a FileNotFoundError naming `model_dir`, the rule's
    input: Snakemake then holds the value as to be decided, and asks again once the job's inputs exist."""
    if not (Path(model_dir) / "card.json").exists():
        raise FileNotFoundError(2, "the model is not acquired yet", str(model_dir))
    floor = config["dtype_floor"]
    measured = bool(floor["samples"]) and task in floor["tasks"]
    return eval_mem_mb(read_card(model_dir), config["dtype"], config["device"], context_tokens, measured)
