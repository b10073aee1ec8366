"""The whole workflow on the tiny model in a temp directory: every rule runs, rows land in DuckDB,
the report is written, and a second run has nothing to do."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import psutil
import pytest
import yaml

from conftest import job_counts, snakemake, workflow_copy
from kvlab.tools.compare_runs import compare
from kvlab.state.config import CALIBRATION_TABLES, resolve
from kvlab.steps.costs import MODEL_SCHEMES
from kvlab.kernels.block_sparse import read_tokens
from kvlab.methods import build, kind_of
from kvlab.state.sequential import planned
from kvlab.tasks import samples_at

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def smoke_config():
    config = yaml.safe_load((ROOT / "config.yaml").read_text())
    return resolve({**config, "preset": "smoke"}, ROOT / "workflow" / "config.schema.yaml")


def expected_samples(spec: dict, max_samples: int) -> int:
    """Samples over every context length: per grid point, `samples` at each length (one number, or one per length),
    then rounds up to max_samples (kvlab.state.sequential.planned). The random tiny model decides no cell in 3 samples (a
    cell that loses every answer needs 6), so every job runs to its last round."""
    points = spec.get("depths") or spec.get("from_end_tokens") or [None]
    per_length = spec["samples"] if isinstance(spec["samples"], list) else [spec["samples"]] * len(spec["context_tokens"])
    return sum(planned(spec, len(points) * n, max_samples) for n in per_length)


def test_every_rule_ran_and_rows_are_in_duckdb(smoke_run):
    con = duckdb.connect(str(smoke_run / "results" / "kvlab.duckdb"), read_only=True)
    config = smoke_config()
    per_method = {name: len(config["budgets"]) if m.evicts else 1 for name, m in build(config["methods"]).items()}
    n_variants = sum(per_method.values())
    n_presses = sum(n for name, n in per_method.items()
                    if config["methods"][name]["kind"] in ("full", "kvpress") and "wrapper" not in config["methods"][name])
    assert any("tasks" in m for m in config["methods"].values())  # the smoke preset exercises the task filter
    assert config["question_modes"] == ["agnostic", "aware", "multi_turn"]
    for task, spec in config["tasks"].items():
        turns = 2 if spec["kind"] == "multi_turn" else 1
        per_variant = turns + 1 + (turns - 1)  # agnostic: every turn; aware: turn 1; multi_turn: the later turns
        here = sum(n for name, n in per_method.items() if task in config["methods"][name].get("tasks", [task]))
        rows = con.execute("SELECT count(*), count(DISTINCT sample_id) FROM eval WHERE task = ?", [task]).fetchone()
        n = expected_samples(spec, config["sequential"]["max_samples"])
        assert rows == (n * here * per_variant, n), task
        for ctx in spec["context_tokens"]:  # each job ran to its cap: its first samples, then rounds of one prompt
            first = expected_samples({**spec, "context_tokens": [ctx], "samples": samples_at(spec, ctx)}, 0)
            cap = expected_samples({**spec, "context_tokens": [ctx], "samples": samples_at(spec, ctx)},
                                   config["sequential"]["max_samples"])
            got = con.execute("SELECT max(round), count(DISTINCT draw), max(draw), min(max_samples), max(max_samples) "
                              "FROM eval WHERE task = ? AND context_tokens = ?", [task, ctx]).fetchone()
            assert got == (1 + cap - first, cap, cap - 1, cap, cap), (task, ctx)
        modes = {m for (m,) in con.execute("SELECT DISTINCT question_mode FROM eval WHERE task = ?", [task]).fetchall()}
        assert modes == ({"agnostic", "aware", "multi_turn"} if turns > 1 else {"agnostic", "aware"}), task
    # prompts-only chat rows (recipe chat_mix, rendered by the tiny model's ChatML template): scored by agreement with
    # the full cache's answer, which agrees with itself
    chat = con.execute("SELECT list(DISTINCT metric), min(score) FILTER (method_kind = 'full'), min(prompt_tokens) "
                       "FROM eval WHERE task = 'chat_mix'").fetchone()
    assert chat[:2] == (["agreement"], 1.0) and chat[2] > 0
    cols = {r[0] for r in con.execute("DESCRIBE eval").fetchall()}
    assert {"model", "task", "task_kind", "context_tokens", "depth", "seed", "method", "budget", "question_mode",
            "turn", "prediction", "score", "kv_bytes", "kl_vs_full", "nll", "ppl", "prefill_s", "decode_s",
            "decode_batch"} <= cols
    assert con.execute("SELECT DISTINCT model FROM eval").fetchall() == [("tiny-qwen2",)]
    # Bytes are read from the stored tensors. Dense rows: tokens held × 512 B (2 layers × K,V × 2 KV heads × 16
    # dims × fp32); the formula prices what the budget asks, so it matches wherever every layer and head keeps
    # exactly that — not PyramidKV's per-layer split, and not AdaKV, which masks keys and frees nothing.
    dense = "scheme IS NULL AND method_kind <> 'cross_layer'"
    assert con.execute(f"SELECT count(*) FROM eval WHERE {dense} AND kv_bytes <> 512 * kv_tokens_mean").fetchone() == (0,)
    # cross-layer sharing (CLA-2): layer 1 holds layer 0's K/V and stores nothing: half of it
    cla = con.execute("SELECT count(*), min(kv_bytes = 256 * kv_tokens_mean), min(compression_vs_bf16) FROM eval "
                      "WHERE method_kind = 'cross_layer'").fetchone()
    assert cla[0] > 0 and cla[1:] == (True, 2.0)
    per_layer = "press = 'PyramidKVPress' OR layer_budgets"  # budgets split by layer
    masks = "kv_kept_mean < kv_tokens_mean"
    exact = f"NOT coalesce({per_layer}, false) AND NOT {masks}"
    assert con.execute(f"SELECT count(*) FROM eval WHERE {exact} AND kv_bytes <> kv_bytes_formula").fetchone() == (0,)
    masked = con.execute(f"SELECT DISTINCT method, kv_tokens_mean = compressed_tokens FROM eval WHERE {masks}").fetchall()
    assert masked == [("adakv", True)]  # every prompt token still stored
    # block-sparse reads store the whole prompt; a step reads the budget's blocks plus the block summaries scored
    sparse = con.execute("SELECT DISTINCT method, budget, compressed_tokens, kv_tokens_mean, kv_read_mean, kv_read_fraction "
                         "FROM eval WHERE method_kind = 'block_sparse' ORDER BY ALL").fetchall()
    assert {(m, b) for m, b, *_ in sparse} == {("moba", 0.25), ("moba", 0.5), ("quest", 0.25), ("quest", 0.5)}
    for method, budget, context, stored, read, share in sparse:
        kind = kind_of(config["methods"][method])
        want = read_tokens(context, kind.params["block"], kind.top_k(budget, context), kind.params["selector"])
        assert stored == context and read == want and share == pytest.approx(want / context), (method, budget, context)
    assert con.execute("SELECT count(*) FROM eval WHERE method_kind <> 'block_sparse' AND kv_read_mean <> kv_kept_mean").fetchone() == (0,)
    # per-layer budgets (PyramidKV, calibrated layer budgets) round per layer: under one token (256 B) per layer off
    split = con.execute(f"SELECT DISTINCT method FROM eval WHERE ({per_layer}) AND NOT {masks}").fetchall()
    assert sorted(split) == [("pyramidkv",), ("snapkv_layers",)]
    assert con.execute(f"SELECT max(abs(kv_bytes - kv_bytes_formula)) <= 2 * 256 FROM eval WHERE ({per_layer}) AND NOT {masks}").fetchone() == (True,)
    # every quantized cache of our own is measured and priced; transformers' baseline is measured only
    assert con.execute("SELECT count(*) FROM eval WHERE kv_bytes_formula IS NULL AND scheme <> 'hf_quanto'").fetchone() == (0,)
    assert con.execute("SELECT min(compression_vs_bf16) > 1 FROM eval WHERE scheme IS NOT NULL").fetchone() == (True,)
    assert con.execute("SELECT max(abs(kl_vs_full)) FROM eval WHERE method_kind = 'full'").fetchone()[0] < 1e-6
    # each compressed row is read along its own full row's answer (same sample, question mode and turn): it has a KL
    # exactly where that full row has one, and a compressed cache's is never zero; prose rows (a reference text) all have one
    pairs = con.execute(
        "SELECT count(*), count(*) FILTER ((c.kl_vs_full IS NULL) <> (f.kl_vs_full IS NULL)), count(*) FILTER (c.kl_vs_full <= 0) "
        "FROM eval c JOIN eval f USING (model, task, context_tokens, sample_id, question_mode, turn) "
        "WHERE c.method_kind <> 'full' AND f.method_kind = 'full'").fetchone()
    assert pairs == (con.execute("SELECT count(*) FROM eval WHERE method_kind <> 'full'").fetchone()[0], 0, 0)
    assert con.execute("SELECT count(*) FROM eval WHERE task_kind = 'continuation' AND kl_vs_full IS NULL").fetchone() == (0,)
    # the noise floor: measured on every full row with a KL path and on no other row; rounding only, in fp32
    assert con.execute("SELECT count(*) FROM eval WHERE kl_vs_full IS NOT NULL "
                       "AND (method_kind = 'full') <> (noise_kl IS NOT NULL)").fetchone() == (0,)
    assert con.execute("SELECT min(noise_kl) >= 0 AND max(noise_kl) < 1e-6 AND min(noise_s) > 0 FROM eval").fetchone() == (True,)
    speed = con.execute("SELECT count(*), min(tokens_per_s), list(DISTINCT batch ORDER BY batch), count(graph_tokens_per_s) "
                        "FROM throughput").fetchone()
    assert speed == (n_variants * 2, speed[1], [1, 2], 0) and speed[1] > 0  # batches of 1 and 2; no CUDA graph on a CPU
    bench = con.execute(
        "SELECT variants, question_modes, agreement_agnostic, pipeline_s > pipeline_agnostic_s FROM engine_vs_pipeline"
    ).fetchall()
    assert bench == [(n_presses, "agnostic,aware", 1.0, True)]  # kvpress's pipeline runs presses only
    # the speedups are the pipeline's seconds over the engine's, for both modes and for the agnostic one alone
    (times,) = con.execute("SELECT engine_s, pipeline_s, speedup, engine_agnostic_s, pipeline_agnostic_s, speedup_agnostic "
                           "FROM engine_vs_pipeline").fetchall()
    assert times[2] == pytest.approx(times[1] / times[0]) and times[5] == pytest.approx(times[4] / times[3])
    assert con.execute("SELECT count(*) FROM costs WHERE source = 'article'").fetchone()[0] == 5
    # the tiny model priced in every scheme at the cost table's context (the model's own maximum when shorter); bf16:
    # layers × K,V × KV heads × head dim × 2 bytes per token
    card = json.loads((smoke_run / "resources" / "models" / "tiny-qwen2" / "card.json").read_text())
    tokens = min(config["report"]["cost_context_tokens"], card["max_position_embeddings"])
    priced = {r[0]: r[1:] for r in con.execute(
        "SELECT scheme, context_tokens, bytes_per_token, total_bytes FROM costs WHERE model = 'tiny-qwen2'").fetchall()}
    bf16 = card["num_layers"] * 2 * card["num_kv_heads"] * card["head_dim"] * 2
    assert sorted(priced) == sorted(MODEL_SCHEMES) and {t for t, *_ in priced.values()} == {tokens}
    assert priced["bf16"] == (tokens, bf16, bf16 * tokens)
    jobs = {r[0] for r in con.execute("SELECT job FROM benchmarks").fetchall()}
    evaluations = {f"evaluate/tiny-qwen2/{t}/{c}" for t, spec in config["tasks"].items() for c in spec["context_tokens"]}
    assert jobs == {"acquire_model/tiny-qwen2", "calibrate/tiny-qwen2", "throughput/tiny-qwen2/256",
                    "engine_vs_pipeline/tiny-qwen2/512"} | evaluations
    for table in CALIBRATION_TABLES:
        assert con.execute(f"SELECT count(*), min(model) FROM calib_{table}").fetchone()[1] == "tiny-qwen2", table
    prov = dict(con.execute("SELECT key, value FROM provenance").fetchall())
    assert prov["preset"] == "smoke" and len(prov["config_hash"]) == 16
    assert (smoke_run / "results" / "eval" / "tiny-qwen2" / "niah_single" / "512.parquet").is_file()
    assert (smoke_run / "resources" / "models" / "tiny-qwen2" / "card.json").is_file()


def test_report_written_from_the_run(smoke_run):
    page = (smoke_run / "results" / "report.html").read_text()
    assert "tiny-qwen2" in page and "<svg" in page
    assert "327,680" in page and "42,949,672,960" in page  # the article's cost table, recomputed
    assert "<h3>Noise floor</h3>" in page and "<th>noise_s</th>" in page  # the floor and what it cost


def test_evaluate_logs_show_progress_per_sample(smoke_run):
    """Each evaluate job logs a line per batch of samples (samples done of the most it may reach, rows, rows per
    second, time left at most) and one per round (variants and cells still open)."""
    log = (smoke_run / "logs" / "evaluate" / "tiny-qwen2" / "niah_single" / "512.log").read_text()
    lines = re.findall(r"sample (\d+)/(\d+): (\d+) rows, [\d.]+ rows/s, \d+ s elapsed, ~\d+ s left at most", log)
    done = [(int(a), int(b)) for a, b, _ in lines]
    assert done and done[-1] == (3, 3) and all(a < b for (a, _), (b, _) in zip(done, done[1:]))
    assert re.search(r"round 1 done \(2 samples\): \d+ of \d+ variants have an open cell \(\d+ cells open\)", log)
    rows = duckdb.connect().execute("SELECT count(*) FROM read_parquet(?)",
                                    [str(smoke_run / "results" / "eval" / "tiny-qwen2" / "niah_single" / "512.parquet")]).fetchone()
    assert (int(lines[-1][2]),) == rows  # the last sample's line counts every row the job wrote


@pytest.mark.xdist_group("smoke")  # runs Snakemake in the smoke run's own folder (conftest.smoke_run)
def test_second_run_has_nothing_to_do(smoke_run):
    proc = snakemake(smoke_run, "results/report.html", "--config", "preset=smoke", "-n")
    assert proc.returncode == 0
    assert "Nothing to be done" in proc.stdout + proc.stderr


@pytest.mark.xdist_group("smoke")  # runs Snakemake in the smoke run's own folder (conftest.smoke_run)
def test_default_preset_plans_the_whole_dag(smoke_run):
    proc = snakemake(smoke_run, "results/report.html", "-n", "--quiet", "rules")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout + proc.stderr
    for rule in ("acquire_model", "calibrate", "evaluate", "throughput", "engine_vs_pipeline", "cost_table", "collect", "report"):
        assert rule in out


# A run of only the user's workload: acquire, calibrate, its evaluation (and the recipe writing its file, for qa_mix),
# then the report's own steps; no speed benchmark and no needle job.
WORKLOAD_ONLY = {"acquire_model", "calibrate", "workload", "evaluate", "cost_table", "collect", "report"}


def test_workload_preset_plans_only_its_own_jobs(tmp_path):
    work = workflow_copy(tmp_path / "w")
    proc = snakemake(work, "results/report.html", "-n", "--quiet", "rules", "--config", "preset=workload")
    assert proc.returncode == 0, proc.stderr[-2000:]
    counts = job_counts(proc.stdout + proc.stderr)
    assert set(counts) == WORKLOAD_ONLY and counts["evaluate"] == 1, counts


def test_traffic_preset_plans_only_its_own_jobs(tmp_path):
    """The shipped prompts-only example (issue 54): its recipe writes chat rows (rule workload), one evaluate job."""
    work = workflow_copy(tmp_path / "w")
    proc = snakemake(work, "results/report.html", "-n", "--quiet", "rules", "--config", "preset=traffic")
    assert proc.returncode == 0, proc.stderr[-2000:]
    counts = job_counts(proc.stdout + proc.stderr)
    assert set(counts) == WORKLOAD_ONLY and counts["evaluate"] == 1 and counts["workload"] == 1, counts


def test_a_preset_of_only_a_dataset_task_plans_no_speed_jobs(tmp_path):
    """A user's preset whose only task is their file (no niah task for benchmark.task), extending the workload preset
    (`speed_benchmarks: []`), is accepted and plans acquire, calibrate and that task's evaluate job (tests/test_config.py:
    with the engine-vs-pipeline benchmark left on, it is refused with the line that says how to turn it off)."""
    work = workflow_copy(tmp_path / "w")
    (work / "data").mkdir()
    rows = [{"context": f"Ticket {i}: the printer in room {i} is out of toner.", "question": f"Which room is ticket {i} about?",
             "answers": [str(i)]} for i in range(6)]
    (work / "data" / "tickets.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = yaml.safe_load((work / "config.yaml").read_text())
    tickets = {"kind": "dataset", "path": "data/tickets.jsonl", "metric": "qa_f1", "samples": 6, "context_tokens": [0],
               "template": "Answer with the room number alone.\n\n{context}\n\nQuestion: {question}"}
    config["presets"]["mine"] = {"extends": "workload", "replace": ["tasks"], "tasks": {"tickets": tickets}}
    (work / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    proc = snakemake(work, "results/report.html", "-n", "--quiet", "rules", "--config", "preset=mine")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-2000:]
    counts = job_counts(proc.stdout + proc.stderr)
    assert set(counts) == WORKLOAD_ONLY - {"workload"} and counts["evaluate"] == 1, counts


@pytest.mark.xdist_group("smoke")  # runs Snakemake in the smoke run's own folder (conftest.smoke_run)
def test_a_method_limited_to_one_task_reruns_only_that_task(smoke_run, tmp_path):
    """Evaluation jobs receive only the methods that run on their task: adding one for `recency` plans that
    evaluation alone (then collect and report)."""
    config = yaml.safe_load((smoke_run / "config.yaml").read_text())
    config["presets"]["smoke"]["methods"]["knorm"] = {"kind": "kvpress", "press": "KnormPress", "tasks": ["recency"]}
    (tmp_path / "more.yaml").write_text(yaml.safe_dump(config, sort_keys=False))  # key order is part of the params
    proc = snakemake(smoke_run, "results/report.html", "-n", "--quiet", "rules", "--configfile", str(tmp_path / "more.yaml"),
                     "--config", "preset=smoke")
    assert proc.returncode == 0, proc.stderr[-2000:]
    counts = job_counts(proc.stdout + proc.stderr)
    assert counts.get("evaluate") == 1 and "calibrate" not in counts, proc.stdout[-2000:]


def _job_runs(proc: subprocess.Popen, script: str) -> bool:
    """Whether a process below Snakemake's `proc` runs the rule script `script` (Snakemake runs a copy of it,
    .snakemake/scripts/tmp<id>.<script>)."""
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return False
    for child in children:
        try:
            if any(part.endswith("." + script) for part in child.cmdline()):
                return True
        except psutil.Error:  # a child that ended while we looked
            continue
    return False


def _default_sigint() -> None:
    """SIGINT as a terminal's Ctrl-C finds it: a shell starts a background job (`make test &`) with SIGINT ignored,
    and Python keeps an inherited SIG_IGN, so Snakemake and its jobs would never see the signal."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupted(work: Path, sig: int, started: Path, script: str, *args: str) -> str:
    """Run the README's command in `work` and send `sig` to its process group (as a terminal's Ctrl-C, or a kill
    of the job's processes) once the job writing `started` runs: Snakemake removes a job's old outputs as it starts
    it, and the file reappears only when the job has finished; the signal goes once that file is gone and the job's
    own process (rule script `script`) is up, since a signal in between reaches no job and the job then finishes
    (a collect of under a second did, in CI). Watching files and processes, not the log, keeps this exact however
    the log is buffered. Returns what the run printed."""
    cmd = [sys.executable, "-m", "snakemake", "--cores", "2", "results/report.html", "--config", "preset=smoke", *args]
    log = work / "interrupted.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=work, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_default_sigint)
        while proc.poll() is None and (started.exists() or not _job_runs(proc, script)):
            time.sleep(0.002)
        assert proc.poll() is None, f"the run ended before its job started: {log.read_text()[-3000:]}"
        os.killpg(proc.pid, sig)
        proc.wait(timeout=120)
    assert not started.exists(), log.read_text()[-3000:]  # interrupted while the job ran
    return log.read_text()


@pytest.fixture
def finished_copy(smoke_run, tmp_path):
    """A copy of the finished smoke run (mtimes and Snakemake's records kept), to interrupt."""
    work = tmp_path / "run"
    shutil.copytree(smoke_run, work, symlinks=True)
    return work


def test_kill_9_during_evaluate_then_the_command_finishes_the_run(smoke_run, finished_copy):
    """kill -9 of the run's processes while an evaluate job runs leaves Snakemake's lock behind; the README's
    command removes it (its run is gone), reruns the half-done job and gives the same rows, nothing half-written."""
    target = "results/eval/tiny-qwen2/niah_single/512.parquet"
    _interrupted(finished_copy, signal.SIGKILL, finished_copy / target, "evaluate.py", "--forcerun", target)
    assert any((finished_copy / ".snakemake" / "locks").glob("*.lock"))  # the interrupted run's lock stayed
    proc = snakemake(finished_copy, "results/report.html", "--config", "preset=smoke")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "removed the lock of an interrupted run" in proc.stderr
    assert all(": same (" in line for line in compare(smoke_run, finished_copy)), compare(smoke_run, finished_copy)
    assert not list((finished_copy / "results").rglob("*.partial*"))
    assert not (finished_copy / ".snakemake" / "locks").exists()


def test_ctrl_c_during_collect_then_the_command_rebuilds_the_database(smoke_run, finished_copy):
    """Ctrl-C while collect runs deletes kvlab.duckdb (Snakemake removes an interrupted job's outputs); the
    README's command rebuilds it and the report from it, instead of 'Nothing to be done'."""
    db = finished_copy / "results" / "kvlab.duckdb"
    _interrupted(finished_copy, signal.SIGINT, db, "collect.py", "--forcerun", "collect")
    assert not db.exists() and (finished_copy / "results" / "report.html").exists()  # the state the fix is for
    proc = snakemake(finished_copy, "results/report.html", "--config", "preset=smoke")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "kvlab.duckdb is missing" in proc.stderr and "Nothing to be done" not in proc.stderr
    counts = job_counts(proc.stdout + proc.stderr)
    assert counts == {"collect": 1, "report": 1}, counts
    with duckdb.connect(str(db), read_only=True) as new, \
            duckdb.connect(str(smoke_run / "results" / "kvlab.duckdb"), read_only=True) as old:
        tables = [t for (t,) in old.execute("SELECT table_name FROM information_schema.tables").fetchall()]
        assert tables and all(new.execute(f"SELECT count(*) FROM {t}").fetchone() == old.execute(
            f"SELECT count(*) FROM {t}").fetchone() for t in tables)
