"""What a measuring rule's script hands its job: the rule's params made concrete on the machine that runs it.

Above the engine and the method kinds (the import contract in pyproject.toml): kvlab.io stays below them.
"""

from __future__ import annotations

from pathlib import Path


def run_settings(smk) -> dict:
    """A measuring job's `run` dict: the rule's params, its threads, `dtype: auto` resolved on the machine that
    runs the job (kvlab.hardware.compute_dtype), and methods with calibrated values filled in from the job's
    calibration input (when it has one)."""
    from kvlab.hardware import compute_dtype
    from kvlab.methods import with_calibration

    run = dict(smk.params.run, threads=smk.threads)
    run["dtype"] = compute_dtype(run["dtype"], run["device"])
    calibration = list(smk.input.get("calibration", []))
    if calibration:
        run["methods"] = with_calibration(run["methods"], Path(calibration[0]).parent)
    return run
