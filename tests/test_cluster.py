"""The SLURM profile: it plans the whole default DAG, asks the scheduler for GPUs only on `device: cuda`, and runs
one job of each node rule of the smoke preset on a real single-node SLURM (tests/slurm_local.py) with the same
results as a local run, its model
taken from an offline Hugging Face cache (`source: hub`, the path users with their own models take)."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest
import yaml

from conftest import hub_cache, job_counts, snakemake, workflow_copy
from kvlab.tools.compare_runs import compare
from kvlab.state.config import resolve
from slurm_local import PARTITION, Unavailable, jobs, local_slurm

pytestmark = pytest.mark.slow

LOCAL_RULES = {"cost_table", "collect", "report"}


def dry_run(work: Path, *args: str) -> str:
    proc = snakemake(work, "--profile", "profiles/slurm", "results/report.html", "-n", *args, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def parsed(work: Path, monkeypatch, *argv: str):
    from snakemake.cli import parse_args

    monkeypatch.chdir(work)
    return parse_args([*argv, "results/report.html"])[1]


def test_profiles_layer_so_cluster_settings_win_on_a_cluster(tmp_path, monkeypatch):
    """profiles/default is snakemake's workflow profile: applied to every run and above --profile, so it must not
    hold a key the SLURM profile sets differently (it once held latency-wait 5, which beat the cluster's 60)."""
    work = workflow_copy(tmp_path / "work")
    local = parsed(work, monkeypatch)
    assert (local.cores, local.executor, local.rerun_incomplete, local.keep_going) == (2, None, True, False)
    cluster = parsed(work, monkeypatch, "--profile", "profiles/slurm")
    assert (cluster.executor, cluster.jobs, cluster.latency_wait, cluster.keep_going) == ("slurm", 50, 60, True)
    assert cluster.rerun_incomplete and not cluster.printshellcmds  # every rule is a script: its "command" prints as None
    assert set(cluster.set_resources) == {"calibrate", "evaluate", "throughput", "engine_vs_pipeline", "decode_kernels"}
    default = yaml.safe_load((work / "profiles" / "default" / "config.yaml").read_text())
    slurm = yaml.safe_load((work / "profiles" / "slurm" / "config.yaml").read_text())
    assert not set(default) & set(slurm)


def test_slurm_profile_plans_the_full_default_dag(tmp_path):
    work = workflow_copy(tmp_path / "work")
    config = resolve(yaml.safe_load((work / "config.yaml").read_text()), work / "workflow" / "config.schema.yaml")
    counts = job_counts(dry_run(work, "--quiet", "rules"))
    evaluated = [m for m, spec in config["models"].items() if spec["evaluate"]]
    assert counts["evaluate"] == len(evaluated) * sum(len(t["context_tokens"]) for t in config["tasks"].values())
    assert counts["acquire_model"] == counts["calibrate"] == len(config["models"])
    assert counts["throughput"] == len(evaluated) * len(config["throughput"]["context_tokens"])
    assert counts["cost_table"] == counts["collect"] == counts["report"] == 1


@pytest.mark.parametrize("device, gpus", [("cpu", 0), ("cuda", 1)])
def test_model_rules_ask_the_scheduler_for_a_gpu_only_on_cuda(tmp_path, device, gpus):
    work = workflow_copy(tmp_path / "work")
    out = dry_run(work, "--config", f"device={device}", "preset=smoke")
    jobs_planned = re.findall(r"^(?:local)?rule (\w+):\n(.*?)(?=^\S|\Z)", out, flags=re.M | re.S)
    seen = {}
    for rule, body in jobs_planned:
        resources = re.search(r"resources: (.*)", body)
        assert resources, f"{rule}: no resources printed"
        seen[rule] = re.search(r"\bgpu=(\d+)", resources.group(1))
    for rule in ("calibrate", "evaluate", "throughput", "engine_vs_pipeline"):
        assert seen[rule] and int(seen[rule].group(1)) == gpus, (rule, device)
    assert ("decode_kernels" in seen) == (device == "cuda")  # the kernel benchmark needs a GPU
    if device == "cuda":
        assert int(seen["decode_kernels"].group(1)) == 1
    for rule in ("acquire_model", *LOCAL_RULES):
        assert not seen[rule], rule


@pytest.fixture
def slurm(tmp_path):
    """A running single-node SLURM (its clients' environment); skipped, with the reason, where none can start."""
    try:
        with local_slurm(tmp_path / "cluster") as env:
            yield env
    except Unavailable as why:
        pytest.skip(f"no SLURM test cluster on this machine: {why}")


SMOKE_MODEL = "      tiny-qwen2: {source: tiny, architecture: qwen2, layers: 2, hidden_size: 64, heads: 4, kv_heads: 2, head_dim: 16}\n"
HUB_MODEL = "      tiny-qwen2: {source: hub, repo_id: kvlab-tests/tiny-qwen2, dtype: float32}\n"


# One job of every rule that runs on a node (decode_kernels needs a GPU): acquire_model and calibrate come with
# them. The local rules (cost_table, collect, report) never go to SLURM; the whole smoke DAG through sbatch took
# 6-10 min on 2 cores, most of it the executor's status polling between ~40 short jobs.
NODE_TARGETS = ("results/eval/tiny-qwen2/niah_single/512.parquet", "results/eval/tiny-qwen2/prose_kl/256.parquet",
                "results/speed/throughput/tiny-qwen2/256.parquet", "results/speed/engine_vs_pipeline/tiny-qwen2/512.parquet")


def test_smoke_preset_runs_through_slurm_as_it_runs_locally(smoke_run, slurm, tmp_path):
    """Each job goes through sbatch on a real SLURM controller and node, and its rows equal the local run's: one
    job of every rule that runs on a node (NODE_TARGETS, with the model acquisition and calibration they need). The
    model is the local run's tiny one, put in a Hugging Face cache and acquired with `source: hub` and
    HF_HUB_OFFLINE=1 (one run for both paths)."""
    work = workflow_copy(tmp_path / "work")
    config = (work / "config.yaml").read_text()
    assert config.count(SMOKE_MODEL) == 1, "the smoke preset's model line changed; update SMOKE_MODEL"
    (work / "config.yaml").write_text(config.replace(SMOKE_MODEL, HUB_MODEL))
    hf_home = tmp_path / "hf"
    commit = hub_cache(hf_home, "kvlab-tests/tiny-qwen2", smoke_run / "resources" / "models" / "tiny-qwen2")
    slurm = {k: v for k, v in slurm.items() if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")}
    slurm.update(HF_HOME=str(hf_home), HF_HUB_OFFLINE="1")
    # The test cluster has no accounting daemon (slurmdbd), hence squeue for status and no account to guess.
    proc = snakemake(work, "--profile", "profiles/slurm", *NODE_TARGETS, "--config", "preset=smoke",
                     "--slurm-status-command", "squeue", "--slurm-init-seconds-before-status-checks", "2",
                     "--slurm-no-account", "--slurm-keep-successful-logs", timeout=1500, env=slurm)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    scheduled = jobs(slurm)

    counts = job_counts(proc.stdout + proc.stderr)
    assert set(counts) == {"acquire_model", "calibrate", "evaluate", "throughput", "engine_vs_pipeline"}, counts
    submitted = {rule: n for rule, n in counts.items() if rule not in LOCAL_RULES}
    assert len(scheduled) == sum(submitted.values()), scheduled
    rules = Counter(re.match(r"rule_(\w+?)(?:_wildcards_|$)", j["Comment"]).group(1) for j in scheduled)
    assert rules == Counter(submitted), (rules, submitted)
    assert all(j["JobState"] == "COMPLETED" and j["ExitCode"] == "0:0" and j["Partition"] == PARTITION for j in scheduled)
    logs = work / ".snakemake" / "slurm_logs"
    for rule, n in counts.items():
        found = list((logs / f"rule_{rule}").rglob("*.log")) if (logs / f"rule_{rule}").is_dir() else []
        assert len(found) == (0 if rule in LOCAL_RULES else n), (rule, found)

    card = json.loads((work / "resources" / "models" / "tiny-qwen2" / "card.json").read_text())
    assert card["source"]["kind"] == "hub" and card["source"]["commit"] == commit
    lines = [line for line in compare(smoke_run, work) if not line.endswith(f"only in {smoke_run}")]
    assert len(lines) >= len(NODE_TARGETS) and all(": same (" in line for line in lines), lines
    assert {line.split(":")[0] for line in lines} >= set(NODE_TARGETS)
