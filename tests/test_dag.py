"""The whole workflow on the tiny model in a temp directory: every rule runs, rows land in DuckDB,
the report is written, and a second run has nothing to do."""

import subprocess
import sys
from pathlib import Path

import duckdb

from conftest import snakemake

ROOT = Path(__file__).resolve().parents[1]


def test_every_rule_ran_and_rows_are_in_duckdb(smoke_run):
    con = duckdb.connect(str(smoke_run / "results" / "kvlab.duckdb"), read_only=True)
    rows = con.execute("SELECT count(*), count(DISTINCT sample_id) FROM eval").fetchone()
    # 2 samples × (full + snapkv at 2 budgets) × 2 question modes
    assert rows == (12, 2)
    cols = {r[0] for r in con.execute("DESCRIBE eval").fetchall()}
    assert {"model", "task", "context_tokens", "depth", "seed", "method", "budget", "question_mode", "prediction",
            "score", "kv_bytes", "prefill_s", "decode_s"} <= cols
    assert con.execute("SELECT DISTINCT model FROM eval").fetchall() == [("tiny-qwen2",)]
    assert con.execute("SELECT count(*) FROM eval WHERE kv_bytes <> kv_bytes_formula").fetchone() == (0,)
    modes = con.execute("SELECT question_mode, count(*) FROM eval GROUP BY 1 ORDER BY 1").fetchall()
    assert modes == [("agnostic", 6), ("aware", 6)]
    assert con.execute("SELECT count(*) FROM costs WHERE source = 'article'").fetchone()[0] == 5
    assert con.execute("SELECT count(*) FROM costs WHERE model = 'tiny-qwen2'").fetchone()[0] > 0
    jobs = {r[0] for r in con.execute("SELECT job FROM benchmarks").fetchall()}
    assert jobs == {"acquire_model/tiny-qwen2", "evaluate/tiny-qwen2/niah_single/512"}
    prov = dict(con.execute("SELECT key, value FROM provenance").fetchall())
    assert prov["preset"] == "smoke" and len(prov["config_hash"]) == 16
    assert (smoke_run / "results" / "eval" / "tiny-qwen2" / "niah_single" / "512.parquet").is_file()
    assert (smoke_run / "resources" / "models" / "tiny-qwen2" / "card.json").is_file()


def test_report_written_from_the_run(smoke_run):
    page = (smoke_run / "results" / "report.html").read_text()
    assert "tiny-qwen2" in page and "<svg" in page
    assert "327,680" in page and "42,949,672,960" in page  # the article's cost table, recomputed


def test_second_run_has_nothing_to_do(smoke_run):
    proc = snakemake(smoke_run, "results/report.html", "--config", "preset=smoke", "-n")
    assert proc.returncode == 0
    assert "Nothing to be done" in proc.stdout + proc.stderr


def test_default_preset_plans_the_whole_dag(smoke_run):
    proc = snakemake(smoke_run, "results/report.html", "-n", "--quiet", "rules")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout + proc.stderr
    for rule in ("acquire_model", "evaluate", "cost_table", "collect", "report"):
        assert rule in out


def test_lint_is_clean():
    proc = subprocess.run([sys.executable, "-m", "snakemake", "--lint"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
