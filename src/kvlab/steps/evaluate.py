"""One evaluation job: a model × a task × a context length, every method × budget × question mode.
Writes one Parquet file, one row per (sample, variant, question mode)."""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch
from tqdm import tqdm

from kvlab.state import memory, resume
from kvlab.state.memory import samples_at_once
from kvlab.engine import Reading, Scope, evaluate_samples
from kvlab.util.hardware import device_name, keep_freed_memory, other_dtype
from kvlab.util.io import write_parquet
from kvlab.kernels.accounting import KVGeometry
from kvlab.methods import variants
from kvlab.models.acquire import DTYPES
from kvlab.models.card import read_card
from kvlab.report.decision import Rule
from kvlab.state.sequential import open_cells, per_point, planned
from kvlab.tasks import generate, max_new_tokens, samples_at
from kvlab.tasks.base import TooFewPrompts

log = logging.getLogger(__name__)

def load_model(model_dir: str | Path, dtype: str, device: str, verify: bool = True, pack: bool = True):
    """The acquired model and tokenizer, `ready` on `device` (the weights first checked against card.json unless
    `verify` is false: a second load in the same job); `pack=False` leaves its linear layers plain (a test that
    changes the weights first, then calls `ready`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-tensor loading bars would bury the job's own progress
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("config device is 'cuda' but torch sees no CUDA device; set device: cpu")
    from kvlab.engine import ATTENTION
    from kvlab.models.integrity import verify_weights

    if verify:
        verify_weights(model_dir)  # the weights are what card.json recorded (once per job; one line if not)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # Off the CPU each weight goes from the weights file straight to the device (`device_map`): the model is never
    # held whole in host memory (an 8B model in bf16: 16 GB, converted from another dtype first). On the CPU the
    # weights load as they always did (memory-mapped, then packed and copied off the map by `ready`).
    placed = {} if device == "cpu" else {"device_map": device}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype], attn_implementation=ATTENTION, **placed)
    return (ready(model, device) if pack else model.to(device).eval().requires_grad_(False)), tokenizer


def ready(model, device: str):
    """`model` in eval mode on `device`; on a CPU its linear layers packed for oneDNN (kvlab.kernels.linear: a
    decode step's few rows stream packed weights faster), every other weight copied off the weights file's memory
    map, which then closes (the pages the packing read would otherwise stay resident beside their packed copies); the
    process then keeps the memory it frees for reuse (`hardware.keep_freed_memory`: no page faults on every large
    temporary)."""
    from kvlab.kernels.linear import pack_linears

    if device == "cpu":
        keep_freed_memory()
    model = model.to(device).eval().requires_grad_(False)  # inference only: no pass records a graph for its weights
    if pack_linears(model):  # none on a GPU (`packable`)
        for p in model.parameters():
            p.data = p.data.clone()
    return model


def noise_samples(run: dict, start: int, total: int) -> int:
    """How many samples of a batch that starts at the job's sample `start` get the noise floor: the noise floor is
    measured on the job's first `noise_floor_samples` samples (default: all `total`)."""
    return max(0, run.get("noise_floor_samples", total) - start)


def check_lengths(task: str, samples: list, cap: int, limit: int) -> None:
    """Every prompt, with its answer's cap, within the model's context (checked before any work: a dataset row at its
    natural length can exceed it)."""
    for s in samples:
        if s.prompt.tokens + cap > limit:
            field = s.meta.get("field", "context")  # a chat row's: messages (kept whole, never cut)
            where = f" ({s.meta['path']} row {s.meta['row']}, field {field})" if "row" in s.meta else ""
            fix = (f"set context_tokens (at most {limit - cap}) to cut long prompts in the middle, or leave the row out"
                   if field == "context" else "a conversation is kept whole: shorten it or leave the row out")
            raise ValueError(f"task '{task}': sample {s.sample_id}{where} has {s.prompt.tokens} prompt tokens + {cap} to "
                             f"generate, beyond the model's context of {limit}; {fix}")


def progress_line(done: int, total: int, rows: int, elapsed: float) -> str:
    """One progress line for the job's log: samples done (of the most it may reach), rows, rows per second and time
    left at most (the rest of the samples at the pace so far; rounds that stop decided cells go faster)."""
    left = elapsed / done * (total - done)
    return (f"sample {done}/{total}: {rows} rows, {rows / elapsed:.2f} rows/s, {elapsed:.0f} s elapsed, "
            f"~{left:.0f} s left at most")


def summary(rows: pd.DataFrame) -> str:
    """A job's result in one line: its mean score with the full cache and the range of the compressed cells' means
    (method, budget, question mode); on a task scored by KL alone (no scores), the range of their mean KL vs full.
    The cells themselves are the report's."""
    compressed = rows[rows["method_kind"] != "full"]
    scored = rows["score"].notna().any()
    cells = compressed.groupby(["method", "budget", "question_mode"])["score" if scored else "kl_vs_full"].mean().dropna()
    if scored:
        full = rows.loc[rows["method_kind"] == "full", "score"].mean()
        spread = f", {cells.min():.2f} to {cells.max():.2f} over {len(cells)} compressed cells" if len(cells) else ""
        return f"mean score {full:.2f} with the full cache{spread}"
    if cells.empty:
        return "no score and no KL vs full measured"
    return f"mean KL vs full {cells.min():.3g} to {cells.max():.3g} nats over {len(cells)} compressed cells"


HEARTBEAT_S = 30.0  # a job logs its progress at least this often, however long one batch of samples takes


@contextmanager
def heartbeat(line):
    """Log `line()` every HEARTBEAT_S seconds from a background thread while the block runs (the log file and the
    terminal both get it: kvlab.util.io.log_to)."""
    every, stop = HEARTBEAT_S, threading.Event()

    def beat():
        while not stop.wait(every):
            log.info("%s", line())

    thread = threading.Thread(target=beat, name="kvlab-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def working(first: int, last: int, total: int, done: int, rows: int, elapsed: float) -> str:
    """The heartbeat's line: the samples in progress, rows so far (those of the batch's samples whose teacher-forced
    passes are done too: the engine decodes their diverged rows together at the batch's end), rows per second and,
    once a sample is done, time left at most (the rest of the samples at the pace so far: a batch decodes its
    full-cache answers first and its diverged rows last, so its first samples look slower than the rest)."""
    left = f"~{elapsed / done * (total - done):.0f} s left at most" if done else "time left known after the first sample"
    return (f"samples {first}-{last}/{total} in progress: {rows} rows, {rows / max(elapsed, 1e-9):.2f} rows/s, "
            f"{elapsed:.0f} s elapsed, {left}")


def time_up(plan: dict, elapsed: float) -> bool:
    """Whether a job stops adding rounds: sequential.stop_after_minutes (opt-in; absent, null or 0: no limit) is each
    job's own share, N minutes of its evaluation (the model's loading aside; a resumed job counts the time before
    its interruption), checked when a round ends, so the first round always runs whole. Its bounds stay valid
    (kvlab.stats.anytime: they hold at any stopping time), but where it stops depends on the machine's speed."""
    limit = plan.get("stop_after_minutes")
    return bool(limit) and elapsed >= 60 * limit


def draw_samples(task: str, spec: dict, tokenizer, context_tokens: int, max_samples: int) -> tuple[list, int]:
    """The job's prompts in draw order, as many as it may reach (kvlab.state.sequential.planned, or fewer where the
    generator runs out of distinct prompts at this length: rows' `max_samples` says how many), and how many the first
    round takes (the task's `samples` per grid point, which must all be distinct: else one line, before any work)."""
    initial = generate(task, spec, tokenizer, context_tokens)
    total = planned(spec, len(initial), max_samples)
    if total == len(initial):
        return initial, len(initial)
    each = per_point(len(initial), samples_at(spec, context_tokens), total)
    try:
        samples = generate(task, {**spec, "samples": each}, tokenizer, context_tokens)[:total]
    except TooFewPrompts as short:  # rounds stop where the generator runs out of distinct prompts (fixed before any answer)
        samples = short.kept[:total]
        log.warning("%s at %d tokens: the generator holds %d distinct prompts, so the job's rounds stop there, not at "
                    "max_samples %d", task, context_tokens, len(samples), total)
    assert [s.sample_id for s in samples[: len(initial)]] == [s.sample_id for s in initial]  # more draws only add
    return samples, len(initial)


@dataclass
class DtypeFloor:
    """The model in the dtype floor's compute dtype (fp32 beside bf16: twice the weights): `dtype` None where the
    run's dtype is the only one that runs in hardware here; it reads the full rows of the job's first `samples`
    samples again, and is held only while a batch has some of them."""

    model_dir: str | Path
    device: str
    dtype: str | None
    samples: int
    model: object = None

    def for_batch(self, start: int) -> tuple[object, int]:
        """The model (None where it has no samples of a batch that starts at the job's sample `start`, or no dtype) and
        how many of the batch's samples it reads; loaded on the batch that needs it first, dropped after the last."""
        in_dtype = max(0, self.samples - start)
        if in_dtype and self.dtype and self.model is None:  # a job resumed past the floor's samples never loads it
            self.model = load_model(self.model_dir, self.dtype, self.device, verify=False)[0]  # the files were verified
            log.info("dtype noise floor: the first %d samples' full rows read again in %s", self.samples, self.dtype)
        elif not in_dtype and self.model is not None:  # the floor's samples done: the rest runs beside one copy
            self.model = None
            if self.device == "cuda":
                torch.cuda.empty_cache()  # its blocks back to the device, for the rest of the job's caches
        return (self.model if in_dtype else None), in_dtype


@dataclass
class Progress:
    """Where a job stands: its checkpoint beside the output after each chunk of samples (kvlab.state.resume), read
    back by a rerun of the same job. Its rows so far; the round under way: its number, the draw it ends at (`end`),
    the rows before it and its seconds so far; the next sample to run; the job's evaluation seconds; the cells still
    open after the last round ((method, budget) -> question modes; None: round 1, every cell)."""

    rows: list = field(default_factory=list)
    round: int = 0
    next: int = 0
    end: int = 0
    before: int = 0
    round_s: float = 0.0
    elapsed: float = 0.0
    still: dict | None = None

    @classmethod
    def load(cls, out_path: str | Path, key: str) -> Progress:
        return cls(**(resume.load(out_path, key) or {}))

    def save(self, out_path: str | Path, key: str, round_s: float, elapsed: float) -> None:
        self.round_s, self.elapsed = round_s, elapsed
        resume.save(out_path, key, dict(vars(self)))


@dataclass
class BatchCount:
    """A batch's samples whose rows the engine has made (`on_rows`), and those rows: the heartbeat's line reads them."""

    samples: int = 0
    rows: int = 0

    def finished(self, rows: int) -> None:
        self.samples += 1
        self.rows += rows


@dataclass
class Evaluation:
    """One evaluation job, ready to run: its model, samples in draw order (the first round's `first` of them),
    variants, decoding cap, dtype floor, memory waves, samples evaluated at once and checkpoint key (`start`)."""

    task: str
    context_tokens: int
    run: dict
    card: dict
    model: object
    tokenizer: object
    plan: dict
    samples: list
    first: int
    grid: list
    cap: int
    floor: DtypeFloor
    floor_skipped: str | None
    waves: object
    at_once: int
    key: str

    @classmethod
    def start(cls, model_dir: str | Path, task: str, task_spec: dict, context_tokens: int, run: dict) -> Evaluation:
        """Load the model, draw the samples and check, before any work, their lengths and the job's memory."""
        card = read_card(model_dir)
        model, tokenizer = load_model(model_dir, run["dtype"], run["device"])
        plan = run.get("sequential", {"max_samples": 0, "round": 1})
        samples, first = draw_samples(task, task_spec, tokenizer, context_tokens, plan["max_samples"])
        grid = variants(run["methods"], run["budgets"], task)
        cap = max_new_tokens(task_spec, run["max_new_tokens"])
        check_lengths(task, samples, cap, model.config.get_text_config().max_position_embeddings)
        rounds = (f"then up to {len(samples)} samples in rounds of {plan['round']} on the variants with an open cell"
                  if len(samples) > first else "a fixed grid")
        log.info("%s: %d samples × %d variants × %d modes, %s; answers capped at %d tokens", task, first, len(grid),
                 len(run["question_modes"]), rounds, cap)
        floor_dtype, floor_skipped = None, None
        longest = max(s.prompt.tokens for s in samples)
        if run.get("dtype_floor_samples", 0) and longest > run.get("dtype_floor_max_tokens", longest):
            floor_skipped = f"prompts of {longest} tokens, above dtype_floor.max_context_tokens {run['dtype_floor_max_tokens']}"
            log.info("dtype noise floor: skipped (%s)", floor_skipped)
            run = {**run, "dtype_floor_samples": 0}
        if run.get("dtype_floor_samples", 0):
            if (floor_dtype := other_dtype(run["dtype"], run["device"])) is None:
                log.info("dtype noise floor: none measured (%s is the only dtype that runs in hardware here)", run["dtype"])
        floor = DtypeFloor(model_dir, run["device"], floor_dtype, run.get("dtype_floor_samples", 0))
        at_once = samples_at_once(context_tokens or longest)  # 0: natural lengths
        waves = memory.job_waves(model, run, grid, longest, cap, floor_dtype is not None, at_once)  # before any work
        key = resume.job_key(task, task_spec, context_tokens, {k: v for k, v in run.items() if k != "memory"}, card)
        return cls(task=task, context_tokens=context_tokens, run=run, card=card, model=model, tokenizer=tokenizer, plan=plan,
                   samples=samples, first=first, grid=grid, cap=cap, floor=floor, floor_skipped=floor_skipped, waves=waves,
                   at_once=at_once, key=key)

    def active(self, still: dict | None) -> list:
        """The variants a round runs: the full cache and those with a cell still open (None: every variant)."""
        return self.grid if still is None else [v for v in self.grid if v.kind == "full" or (v.method, v.budget) in still]

    def batch(self, progress: Progress, start: int, chunk: list, active: list, t0: float) -> list[dict]:
        """The rows of one batch of samples (the job's samples `start`... : `chunk`), each with its draw and round."""
        other, in_dtype = self.floor.for_batch(start)
        count = BatchCount()

        def line() -> str:
            return working(start + 1, start + len(chunk), len(self.samples), start + count.samples,
                           len(progress.rows) + count.rows, time.perf_counter() - t0)

        with heartbeat(line):
            reading = Reading(noise_samples=noise_samples(self.run, start, len(self.samples)), other=other,
                              other_samples=in_dtype)
            found = evaluate_samples(self.model, self.tokenizer, chunk, active, self.run["question_modes"], self.cap,
                                     reading, Scope(open_modes=progress.still, waves=self.waves, on_rows=count.finished))
        draw = {s.sample_id: start + i for i, s in enumerate(chunk)}
        return [{**r, "draw": draw[r["sample_id"]], "round": progress.round} for r in found]

    def rounds(self, progress: Progress, out_path: str | Path, bar, t0: float) -> str:
        """Run the job's rounds from `progress` (a checkpoint after each chunk and each round) until every sample ran,
        no cell is open or the time is up; why it stopped: "max_samples", "decided" or "time"."""
        active = self.active(progress.still)
        while progress.next < len(self.samples):
            if progress.next == progress.end:  # a new round (else: the round a checkpoint was saved in)
                progress.round += 1
                take = self.first if progress.round == 1 else self.plan["round"]
                progress.end, progress.before, progress.round_s = min(len(self.samples), progress.next + take), len(progress.rows), 0.0
            t_round = time.perf_counter() - progress.round_s
            for start in range(progress.next, progress.end, self.at_once):
                chunk = self.samples[start : min(progress.end, start + self.at_once)]
                progress.rows.extend(self.batch(progress, start, chunk, active, t0))
                progress.next = start + len(chunk)
                bar.update(len(chunk))
                bar.set_postfix(rows=len(progress.rows), rows_per_s=f"{len(progress.rows) / (time.perf_counter() - t0):.2f}")
                log.info("%s", progress_line(progress.next, len(self.samples), len(progress.rows), time.perf_counter() - t0))
                if progress.next < progress.end:
                    progress.save(out_path, self.key, time.perf_counter() - t_round, time.perf_counter() - t0)
            seconds = time.perf_counter() - t_round
            for r in progress.rows[progress.before :]:
                r["round_s"] = seconds  # the round's wall seconds (its rows share them)
            if progress.next < len(self.samples):
                if stopped_by := self.stop_after_round(progress, t0):
                    return stopped_by
                active = self.active(progress.still)
                progress.before = len(progress.rows)
                progress.save(out_path, self.key, 0.0, time.perf_counter() - t0)
        return "max_samples"

    def stop_after_round(self, progress: Progress, t0: float) -> str | None:
        """After a round that left samples to run: the cells still open (into `progress`), and why the job stops now
        ("decided": none is open; "time": sequential.stop_after_minutes is spent), or None to go on."""
        progress.still = open_cells(pd.DataFrame(progress.rows), Rule(**self.plan.get("rule", {})))
        active, open_now = self.active(progress.still), sum(map(len, progress.still.values()))
        log.info("round %d done (%d samples): %d of %d variants have an open cell (%d cells open)", progress.round,
                 progress.next, len(active) - 1, len(self.grid) - 1, open_now)
        if len(active) == 1:
            return "decided"
        if time_up(self.plan, time.perf_counter() - t0):
            log.info("stopped after round %d: the job's %g minutes (sequential.stop_after_minutes) are spent; "
                     "%d cells stay open", progress.round, self.plan["stop_after_minutes"], open_now)
            return "time"
        return None

    def frame(self, rows: list[dict], stopped_by: str) -> pd.DataFrame:
        """The job's rows as written: with the columns every row of the job shares, typed, and the byte-accounting
        formula beside the measured bytes."""
        frame = pd.DataFrame(rows)
        frame["max_samples"] = len(self.samples)  # the most prompts this job could reach
        frame["stopped_by"] = stopped_by
        frame.insert(0, "model", self.card["name"])
        frame["dtype"] = self.run["dtype"]
        frame["max_new_tokens"] = self.cap  # the decoding cap the answers ran under
        frame["diverged_at"] = frame["diverged_at"].astype("Int64")  # null where a row never left the full answer
        frame = frame.astype({"noise_kl": "float64", "noise_kl_max": "float64", "noise_s": "float64", "noise_diverged_at": "Int64",
                              "noise_dtype": "string", "dtype_noise_kl": "float64", "dtype_noise_kl_max": "float64",
                              "dtype_noise_diverged_at": "Int64", "dtype_noise_s": "float64"})  # full rows only (typed where all are empty)
        # The byte-accounting formula beside the measured bytes: for dense caches, the kept fraction of the
        # context at the run's dtype (what the budget asks for: presses that free nothing show up here); for
        # quantized caches the engine already wrote codes + metadata + residual for the tokens held.
        geom = KVGeometry.from_card(self.card)
        dense = frame["scheme"].isna()
        kinds = {(v.method, v.budget): v.impl for v in self.grid}
        frame.loc[dense, "kv_bytes_formula"] = [
            kinds[m, b].formula_bytes(geom, self.run["dtype"], b, n, held, prefix=0 if pd.isna(p) else int(p)) for m, b, n, held, p in zip(
                frame.loc[dense, "method"], frame.loc[dense, "budget"], frame.loc[dense, "compressed_tokens"], frame.loc[dense, "kv_tokens_mean"],
                frame.loc[dense, "prefix_tokens"] if "prefix_tokens" in frame else [None] * int(dense.sum()))  # the prompt's uncompressed prefix
        ]
        frame["device"] = device_name(self.run["device"])
        frame["dtype_floor_skipped"] = self.floor_skipped  # why this job measured no dtype floor though its task lists it
        return frame


def run_job(model_dir: str | Path, task: str, task_spec: dict, context_tokens: int, run: dict, out_path: str | Path) -> pd.DataFrame:
    """Evaluate every configured variant on the task's samples; write the rows to `out_path` (Parquet).

    `run` holds the evaluation knobs: methods, budgets, question_modes, max_new_tokens, dtype, device, threads,
    noise_floor_samples (the noise floor is measured on the job's first samples; default: all), dtype_floor_samples
    (the first samples whose full rows the model in the other compute dtype reads again; default: none), and
    sequential ({max_samples, round, rule: the Rule fields it stops on}; default: the task's samples only). The job runs in rounds
    (kvlab.state.sequential): the task's samples on every variant, then `round` more prompts at a time on the full cache
    and the variants with a cell still open, until none is or max_samples prompts ran, or, with
    sequential.stop_after_minutes N, until a round ends after N minutes of the job's evaluation (`time_up`). Rows
    record the sample's `draw` (its index in draw order), its `round`, that round's wall seconds `round_s`, the job's
    `max_samples` and why it stopped (`stopped_by`: "decided", "max_samples" or "time").
    Progress goes to the log after each batch of samples and, from a heartbeat thread, at least every HEARTBEAT_S
    seconds within one (rows so far, rows per second, time left).
    After each chunk of samples the job saves a checkpoint beside `out_path` (`Progress`, kvlab.state.resume); a rerun
    of the same job continues from it and writes the rows an uninterrupted run would (timing columns aside).
    """
    torch.set_num_threads(run["threads"])
    job = Evaluation.start(model_dir, task, task_spec, context_tokens, run)
    progress = Progress.load(out_path, job.key)
    if progress.next:
        log.info("resumed from %s: %d samples done, in round %d", resume.path_for(out_path), progress.next, progress.round)
    t0 = time.perf_counter() - progress.elapsed
    with tqdm(total=len(job.samples), initial=progress.next, desc=f"{job.card['name']}/{task}/{context_tokens}", unit="sample",
              mininterval=0) as bar:
        stopped_by = job.rounds(progress, out_path, bar, t0)
    frame = job.frame(progress.rows, stopped_by)
    log.info("done in %.1f s: %d rows; %s", time.perf_counter() - t0, len(frame), summary(frame))
    write_parquet(frame, out_path)
    resume.clear(out_path)
    return frame
