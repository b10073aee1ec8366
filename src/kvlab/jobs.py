"""What a measuring job receives: the rule's params (`run_params`, built from the config by rules/common.smk and by
the command-line tools that run one job, kvlab.bench_eval and kvlab.profile_eval), made concrete on the machine
that runs it (`run_settings`).

Above the engine and the method kinds (the import contract in pyproject.toml): kvlab.io stays below them.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from kvlab.methods import Method, for_task, with_calibration

RUN_KEYS = ("budgets", "question_modes", "max_new_tokens", "noise_floor_samples", "dtype", "device")


def run_params(config: dict, methods: Mapping[str, Method], task: str | None = None) -> dict:
    """The evaluation knobs a measuring job receives (threads are added from the job): the typed `methods` (built
    once from config['methods'], kvlab.methods.build) and, with `task`, only those that run on it, so adding a
    method limited to some tasks reruns only those tasks' jobs; the task's rounds (kvlab.sequential), decided at
    the report's thresholds; the dtype floor's samples on its tasks only."""
    run = {key: config[key] for key in RUN_KEYS}
    floor = config["dtype_floor"]  # only its tasks' jobs get the key: listing a task reruns that task's jobs alone
    if floor["samples"] and task in floor["tasks"]:
        run["dtype_floor_samples"] = floor["samples"]
    if task is not None:
        seq, decision = config["sequential"], config["decision"]
        run["sequential"] = {
            "max_samples": config["tasks"][task].get("max_samples", seq["max_samples"]),
            "round": seq["round"],
            "tolerance_points": decision["tolerance_points"],
            "kl_safe": decision["kl_safe"],
            "kl_cap_ratio": decision["kl_cap_ratio"],
        }
    return {"methods": for_task(methods, task), **run}


def run_settings(smk) -> dict:
    """A measuring job's `run` dict: the rule's params, its threads, `dtype: auto` resolved on the machine that
    runs the job (kvlab.hardware.compute_dtype), and methods with calibrated values filled in from the job's
    calibration input (when it has one)."""
    from kvlab.hardware import compute_dtype

    run = dict(smk.params.run, threads=smk.threads)
    run["dtype"] = compute_dtype(run["dtype"], run["device"])
    calibration = list(smk.input.get("calibration", []))
    if calibration:
        run["methods"] = with_calibration(run["methods"], Path(calibration[0]).parent)
    return run
