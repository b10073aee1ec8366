"""The decision table so far, from a second terminal while a run goes on:

    python -m kvlab.tools.progress [--results results] [--config config.yaml] [--preset NAME]

It reads the finished evaluation jobs (results/eval/<model>/<task>/<context>.parquet) and the checkpoints of the
running ones (`<output>.partial`, kvlab.state.resume: the rows so far), and prints one line per job cell (model, task,
context length, question mode, method, budget): decided or open, n, its bounds and, for an open cell, about how many
more prompts it needs. It decides them as the report does (the report's `answers` query, kvlab.report.decision
with the Rule of the config's `decision`) and writes results/progress.html in the report's style.

A checkpoint is only read: its bytes are copied into memory and unpickled there, so the running job, which replaces
it by a rename (kvlab.util.io.atomic_path), never finds it open or locked. A running job's cells are those of its rows so
far: a decision made here stands (the bounds are valid at any n, kvlab.stats.anytime), and a cell open here may be decided
by rounds still to come. Checkpoints are not checked against the run's config (their key needs the model's card and
the code), so one an earlier config left is shown too until its job runs again.
"""

from __future__ import annotations

import argparse
import pickle
from pathlib import Path

import duckdb
import pandas as pd
import yaml

from kvlab.steps.collect import _with_columns, joined
from kvlab.util.columns import EVAL_COLUMNS
from kvlab.state.config import resolve
from kvlab.util.io import atomic_path, read_parquet
from kvlab.report.build import CSS, load_queries
from kvlab.report.decision import Rule, cells, shown, tail, why_open
from kvlab.report.html import esc, section, table

ROOT = Path(__file__).resolve().parents[3]
BY = ["model", "task", "context_tokens", "question_mode"]  # with method and budget: one job cell


def checkpoint_rows(path: Path, config: dict) -> pd.DataFrame:
    """A running job's rows so far, from its checkpoint (copied into memory, never opened for writing), with the
    columns run_job adds at its end that the decisions read: model (from the path) and max_samples (the config's)."""
    state = pickle.loads(path.read_bytes())["state"]
    frame = pd.DataFrame(state["rows"])
    if frame.empty:
        return frame
    task = path.parent.name
    most = config["tasks"].get(task, {}).get("max_samples", config["sequential"]["max_samples"])
    return frame.assign(model=path.parent.parent.name, max_samples=max(int(most), frame["draw"].nunique()))


def eval_rows(results: Path, config: dict) -> tuple[pd.DataFrame, list[str]]:
    """Every finished job's rows and every running job's rows so far, typed as collect types them; and one line per
    running job (its samples so far)."""
    frames, running = [], []
    for out in sorted((results / "eval").glob("*/*/*.parquet")):
        frames.append(read_parquet(out))
    for partial in sorted((results / "eval").glob("*/*/*.parquet.partial")):
        out = partial.with_name(partial.name.removesuffix(".partial"))
        if out.exists():
            continue  # the job just finished: its output is read above
        try:
            rows = checkpoint_rows(partial, config)
        except FileNotFoundError:  # it finished between the listing and the read
            if out.exists():
                frames.append(read_parquet(out))
            continue
        if len(rows):
            frames.append(rows)
            running.append(f"{out.relative_to(results / 'eval').with_suffix('')}: {rows['draw'].nunique()} samples so far, "
                           f"round {int(rows['round'].max())}")
    frame = joined(frames) if frames else pd.DataFrame()
    return _with_columns(frame, EVAL_COLUMNS), running


def answers(frame: pd.DataFrame) -> pd.DataFrame:
    """The report's `answers` query (queries.sql) on these rows."""
    con = duckdb.connect()
    try:
        con.register("eval", frame)
        return con.execute(load_queries()["answers"]).df()
    finally:
        con.close()


def table_so_far(rows: pd.DataFrame, rule: Rule) -> pd.DataFrame:
    """One row per job cell: decided (its own decision: safe or unsafe) or open, n, its bounds, and for an open cell
    why (about how many more prompts, or max_samples reached); `kept` whether e-BH over the cells so far keeps it."""
    columns = [*BY, "method", "budget", "state", "n", "bounds", "needs", "kept by e-BH so far"]
    if rows.empty:
        return pd.DataFrame(columns=columns)
    c = cells(rows, rule, by=BY)
    kl = c["kl_low"].notna() if "kl_low" in c else pd.Series(False, index=c.index)
    low, high = (c[k] if k in c else pd.Series(float("nan"), index=c.index) for k in ("drop_low", "drop_high"))
    bounds = [f"KL [{r['kl_low']:.3g}, {r['kl_high']:.3g}] nat; {tail(r)}" if is_kl else f"drop [{lo:+.1f}, {hi:+.1f}] pts"
              for (_, r), is_kl, lo, hi in zip(c.iterrows(), kl, low, high)]
    state = ["open" if r["decision"] == "inconclusive" else f"decided {shown(r, r['decision'])}"
             if r["decision"] in ("safe", "unsafe") else r["decision"] for _, r in c.iterrows()]
    needs = [why_open(r) if r["decision"] == "inconclusive" else "" for _, r in c.iterrows()]
    kept = ["yes" if t == d and d in ("safe", "unsafe") else "" for t, d in zip(c["table_decision"], c["decision"])]
    out = c[[*BY, "method", "budget"]].assign(state=state, n=c["samples"], bounds=bounds, needs=needs)
    out["kept by e-BH so far"] = kept
    return out[columns]


def page(t: pd.DataFrame, running: list[str], rule: Rule) -> str:
    decided = int(t["state"].str.startswith("decided").sum())
    body = (f"<p>{decided} of {len(t)} job cells decided, {int((t['state'] == 'open').sum())} open, from the finished "
            f"jobs and {len(running)} running one(s): {esc('; '.join(running)) or 'none'}. Decided: the cell's "
            f"own test at {rule.tolerance_points:g} points (prose: {rule.kl_safe:g} nat), valid at any n; 'kept by "
            "e-BH so far' over the cells so far (the report's table keeps the run's whole table). An open cell's "
            "'needs' is about how many more prompts like its own would decide it (a low estimate).</p>" + table(t))
    return ("<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>kvlab: progress</title>"
            f"<style>{CSS}</style></head><body>{section('Decisions so far', body)}</body></html>")


def load_rule(config_path: Path, preset: str | None) -> tuple[dict, Rule]:
    config = yaml.safe_load(config_path.read_text())
    if preset:
        config["preset"] = preset
    config = resolve(config, ROOT / "workflow" / "config.schema.yaml")
    return config, Rule(**config["decision"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvlab.tools.progress", description="The decision table so far, from "
                                     "finished evaluation jobs and the checkpoints of running ones (read only).")
    parser.add_argument("--results", default="results", help="the run's results folder (default: results)")
    parser.add_argument("--config", default="config.yaml", help="the run's config file (its `decision` rule)")
    parser.add_argument("--preset", help="the preset the run uses (default: the config's)")
    args = parser.parse_args(argv)
    results = Path(args.results)
    config, rule = load_rule(Path(args.config), args.preset)
    frame, running = eval_rows(results, config)
    t = table_so_far(answers(frame) if len(frame) else pd.DataFrame(), rule)
    with pd.option_context("display.max_rows", None, "display.max_columns", None, "display.width", 200):
        print(t.to_string(index=False) if len(t) else f"no evaluation rows under {results / 'eval'} yet")
    print(f"{int(t['state'].str.startswith('decided').sum())} of {len(t)} job cells decided; running: "
          + ("; ".join(running) or "none"))
    with atomic_path(results / "progress.html") as tmp:
        tmp.write_text(page(t, running, rule), encoding="utf-8")
    print(f"wrote {results / 'progress.html'}")


if __name__ == "__main__":
    main()
