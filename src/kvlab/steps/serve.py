"""One serving-engine job: a model × a task × a context length through a serving engine's own KV caches
(kvlab.methods.serving), every method of that engine beside the engine's default cache, on the prompts kvlab's
evaluation job of the same model, task and length draws (the same token ids, the same sample ids).

The rounds, checkpoints and stopping are those of kvlab's jobs (`kvlab.steps.evaluate.Evaluation`); what differs is
who answers a batch: the engine, in its own environment (kvlab.engine.llamacpp or kvlab.engine.vllm_runner, one runner per
batch, which reads a REQUEST file and writes an ANSWERS file). Rows carry the columns of kvlab's rows under the model
``<model>@<engine>``, whose full cache is the engine's default one (llama.cpp: f16; vLLM: auto, the model's dtype),
so every query, verdict and report section reads them as it reads any model's. A serving engine's cache is the same
whenever the question comes, so its rows are the agnostic question mode's alone.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from kvlab.methods import KINDS, variants
from kvlab.methods.base import NO_STORAGE
from kvlab.models.card import read_card
from kvlab.state import resume
from kvlab.steps.evaluate import Evaluation, Progress, check_lengths, draw_samples, summary
from kvlab.tasks import max_new_tokens
from kvlab.tasks.scoring import AGREEMENT, score
from kvlab.util.hardware import cpu_model, device_name
from kvlab.util.io import write_parquet

log = logging.getLogger(__name__)

AT_ONCE = 16  # samples per engine runner (each loads the model once per cache type)


def runner(engine: str) -> Path:
    """The engine's runner script (run by the engine's python, never imported here)."""
    return Path(__file__).resolve().parents[1] / "engine" / KINDS[engine].runner


def engine_python(engine: str) -> str:
    """The interpreter of the engine's own environment (.venv-<engine>, `make <engine>-env`; KVLAB_<ENGINE>_PYTHON
    overrides); one line naming the make target where it is missing."""
    python = os.environ.get(f"KVLAB_{engine.upper()}_PYTHON", f".venv-{engine}/bin/python")
    if not Path(python).exists():
        label = KINDS[engine].label
        raise FileNotFoundError(f"{python} not found: the {label} environment is built by `make {engine}-env` "
                                f"(or set KVLAB_{engine.upper()}_PYTHON to a python with {label} installed)")
    return python


@dataclass
class Asked:
    """One prompt the engine reads: a sample's turn (its token ids in full), its gold answers and its KL path (the
    sample's reference text; None: the reference cache's own answer)."""

    sample: object
    number: int
    ids: list[int]
    gold: list[str]
    path: list[int] | None
    cap: int

    @property
    def key(self) -> str:
        return f"{self.sample.sample_id}#{self.number}"


def turns(sample, cap: int) -> list[Asked]:
    """A sample's turns as kvlab's engine asks them (kvlab.engine.sample.plan): the context, then the first question
    and the suffix, each later turn's ids after the earlier turns'; prose is read along its reference text alone."""
    p, out = sample.prompt, []
    tail = p.question + p.suffix
    for number, gold in enumerate([sample.gold] + [t.gold for t in p.followups], start=1):
        if number > 1:
            tail = tail + p.followups[number - 2].ids
        path = p.reference if p.reference and number == 1 else None
        out.append(Asked(sample, number, p.context + tail, gold, path, cap if sample.metric != "none" else 0))
    return out


@dataclass
class Serving(Evaluation):
    """A serving-engine job, ready to run (`Evaluation`'s rounds; no torch model: the engine answers each batch)."""

    engine: str = "llamacpp"
    model_dir: str = ""
    gguf: str | None = None
    eos: tuple = ()

    @classmethod
    def start(cls, engine: str, model_dir: str | Path, gguf: str | Path | None, task: str, task_spec: dict,
              context_tokens: int, run: dict) -> Serving:
        """Draw the samples and check, before any work, the engine's environment and the prompts' lengths."""
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        engine_python(engine)
        card = read_card(model_dir)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        plan = run.get("sequential", {"max_samples": 0, "round": 1})
        samples, first = draw_samples(task, task_spec, tokenizer, context_tokens, plan["max_samples"])
        grid = variants(run["methods"], run["budgets"], task, engine=engine)
        cap = max_new_tokens(task_spec, run["max_new_tokens"])
        check_lengths(task, samples, cap, AutoConfig.from_pretrained(model_dir).get_text_config().max_position_embeddings)
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
        log.info("%s through %s: %d samples × %d caches beside its default one, then rounds up to %d samples", task,
                 KINDS[engine].label, first, len(grid) - 1, len(samples))
        key = resume.job_key(engine, task, task_spec, context_tokens, {k: v for k, v in run.items() if k != "memory"}, card)
        return cls(task=task, context_tokens=context_tokens, run=run, card=card, model=None, tokenizer=tokenizer, plan=plan,
                   samples=samples, first=first, grid=grid, cap=cap, floor=None, floor_skipped=None, waves=None,
                   at_once=AT_ONCE, key=key, engine=engine, model_dir=str(model_dir), gguf=gguf and str(gguf),
                   eos=tuple(eos if isinstance(eos, list) else [eos]))

    def batch(self, progress: Progress, start: int, chunk: list, active: list, t0: float) -> list[dict]:
        """The rows of one batch of samples, answered by the engine in one process."""
        asked = [t for s in chunk for t in turns(s, self.cap)]
        caches = {v.method: (KINDS[self.engine].REFERENCE if v.kind == "full" else v.impl.cache) for v in active}
        reference = next(v.method for v in active if v.kind == "full")
        answers = self.ask(asked, caches, reference)
        draw = {s.sample_id: start + i for i, s in enumerate(chunk)}
        return [{**row, "draw": draw[t.sample.sample_id], "round": progress.round}
                for t in asked for row in self.rows(t, active, answers, reference)]

    def ask(self, asked: list[Asked], caches: dict, reference: str) -> dict:
        """The engine's answers (its runner's ANSWERS) to `asked` with every cache, the byte figure checked."""
        longest = max(len(t.ids) + max(t.cap, len(t.path or ())) for t in asked)
        name = KINDS[self.engine].label
        request = {"gguf": self.gguf, "model": self.model_dir, "dtype": self.dtype, "device": self.run["device"],
                   "threads": self.run["threads"], "n_ctx": 256 * math.ceil((longest + 1) / 256), "eos": list(self.eos),
                   "reference": reference, "caches": caches,
                   "prompts": [{"id": t.key, "prompt": t.ids, "max_new_tokens": t.cap, "path": t.path, "continues": t.number > 1}
                               for t in asked]}
        with tempfile.TemporaryDirectory(prefix=f"kvlab-{self.engine}-") as tmp:
            (Path(tmp) / "request.json").write_text(json.dumps(request))
            t0 = time.perf_counter()
            command = [engine_python(self.engine), str(runner(self.engine)), f"{tmp}/request.json", f"{tmp}/answers.json"]
            with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as process:
                said = [""]
                for line in process.stdout:  # its progress into the job's log as it comes
                    said.append(line.rstrip())
                    log.info("%s: %s", name, said[-1])
            if process.returncode:
                raise RuntimeError(f"{name}'s runner failed (exit {process.returncode}): {said[-1] or '(no output)'}")
            answers = json.loads((Path(tmp) / "answers.json").read_text())
        log.info("%s: %d prompts × %d caches in %.1f s", answers["engine"], len(asked), len(caches), time.perf_counter() - t0)
        for cache_name, cache in answers["caches"].items():
            KINDS[self.engine].check_bytes(cache_name, cache)
        return answers

    @property
    def dtype(self) -> str:
        """The dtype the engine computes in (its kind's `compute_dtype`)."""
        return KINDS[self.engine].compute_dtype(self.run["dtype"])

    def rows(self, t: Asked, active: list, answers: dict, reference: str) -> list[dict]:
        """One turn's rows, one per cache (the question mode agnostic: the cache is the same whenever it is asked)."""
        context = len(t.sample.prompt.context)
        ref_ids = answers["caches"][reference]["answers"][t.key]["ids"]
        gold = [self.tokenizer.decode(ref_ids, skip_special_tokens=True)] if t.sample.metric in AGREEMENT else t.gold
        out = []
        for v in active:
            cache = answers["caches"][v.method]
            a = cache["answers"][t.key]
            prediction = self.tokenizer.decode(a["ids"], skip_special_tokens=True)
            token_bytes = KINDS[self.engine].cache_bytes(cache)
            bf16 = 2 * cache["layers"] * cache["kv_heads"] * cache["head_dim"] * 2
            kl = a["kl_vs_full"]
            out.append({
                **t.sample.row(), "method": v.method, "method_kind": v.kind, "press": None, "wrapper": None,
                "press_kwargs": None, "layer_budgets": False, **(NO_STORAGE if v.kind == "full" else v.storage),
                "budget": v.budget, "turn": t.number, "gold": list(gold), "compressed_tokens": context,
                "prediction": prediction, "score": score(t.sample.metric, prediction, gold), "kv_bytes": context * token_bytes,
                "kv_tokens_mean": float(context), "kv_bytes_formula": float(context * token_bytes),
                "compression_vs_bf16": bf16 / token_bytes, "kl_vs_full": kl, "kl_max": a["kl_max"], "nll": a["nll"],
                "ppl": math.exp(a["nll"]) if a["nll"] is not None else None, "tf_tokens": a["tf_tokens"],
                "decode_s": a["decode_s"], "teacher_forced_s": a["teacher_forced_s"], "new_tokens": len(a["ids"]),
                "diverged_at": a["diverged_at"], "decode_batch": 1, "waves": 1, "question_mode": "agnostic",
                "engine": answers["engine"], "engine_kv_mib": cache["kv_mib_engine"],
                "engine_kv_cells": cache["kv_cells"], "kvlab_model": self.card["name"],
                "kvlab_twin": v.method if v.kind == "full" else v.params.get("kvlab_twin"),
            })
        return out

    def frame(self, rows: list[dict], stopped_by: str) -> pd.DataFrame:
        """The job's rows as written: under the model `<model>@<engine>`, with the columns every row of the job shares."""
        frame = pd.DataFrame(rows)
        frame["max_samples"] = len(self.samples)
        frame["stopped_by"] = stopped_by
        frame.insert(0, "model", f"{self.card['name']}@{self.engine}")
        frame["dtype"] = self.dtype
        frame["max_new_tokens"] = self.cap
        frame["diverged_at"] = frame["diverged_at"].astype("Int64")
        where = cpu_model() if self.run["device"] == "cpu" else device_name(self.run["device"])
        frame["device"] = f"{where} ({KINDS[self.engine].label}, {self.run['threads']} threads)"
        return frame


def run_serving_job(engine: str, model_dir: str | Path, gguf: str | Path | None, task: str, task_spec: dict,
                    context_tokens: int, run: dict, out_path: str | Path) -> pd.DataFrame:
    """Answer the task's samples with every method of serving engine `engine` in `run` and the engine's default cache,
    in rounds as kvlab's jobs run (`kvlab.steps.evaluate.run_job`); write the rows to `out_path` (Parquet)."""
    from tqdm import tqdm

    job = Serving.start(engine, model_dir, gguf, task, task_spec, context_tokens, run)
    progress = Progress.load(out_path, job.key)
    t0 = time.perf_counter() - progress.elapsed
    with tqdm(total=len(job.samples), initial=progress.next, desc=f"{job.card['name']}@{engine}/{task}/{context_tokens}",
              unit="sample", mininterval=0) as bar:
        stopped_by = job.rounds(progress, out_path, bar, t0)
    frame = job.frame(progress.rows, stopped_by)
    log.info("done in %.1f s: %d rows; %s", time.perf_counter() - t0, len(frame), summary(frame))
    write_parquet(frame, out_path)
    resume.clear(out_path)
    return frame
