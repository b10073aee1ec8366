"""One sample's rows: every variant × question mode × turn, from one shared prefill per compression."""

from __future__ import annotations

import json
import time

from kvlab.engine.compress import cache_stats, compress
from kvlab.engine.decode import divergence, greedy_decode, teacher_forced, verified_decode
from kvlab.engine.prefill import prefill
from kvlab.methods import Variant
from kvlab.tasks.base import Sample
from kvlab.tasks.scoring import score


QUESTION_MODES = {  # mode -> (what the cache was compressed with, which turns it labels)
    "agnostic": ("agnostic", lambda turn: True),  # the context alone: no question ever seen
    "aware": ("aware", lambda turn: turn == 1),  # the question asked is inside the compressed prompt
    "multi_turn": ("aware", lambda turn: turn > 1),  # compressed for the first question, asked a later one
}


def evaluate_sample(
    model, tokenizer, sample: Sample, variants: list[Variant], modes: list[str], max_new_tokens: int, kl: bool = True
):
    """Rows for one sample: every variant × question mode × turn, from one shared prefill per compression.

    Question modes (`QUESTION_MODES`): `agnostic` compresses the context before any question (every turn is
    asked on it); `aware` compresses context and question together and answers that question; `multi_turn`
    reuses the aware cache for the sample's later turns (a different question about another needle), so it
    only has rows on samples with follow-up turns. A sample whose question sits inside the context (asked
    before the document) is compressed once for both agnostic and aware.

    Per compression, each variant compresses its own copy of the prefilled cache; all variants then decode
    as one batch. With `kl`, KL and NLL are teacher-forced along one path per sample and turn: the sample's
    reference text if it has one, else the full cache's own answer (so KL measures how far each method
    drifts from full).
    """
    if sum(v.kind == "full" for v in variants) != 1:
        raise ValueError("the engine needs exactly one 'full' variant as the reference for KL")
    ref = next(i for i, v in enumerate(variants) if v.kind == "full")
    p = sample.prompt
    t0 = time.perf_counter()
    context = prefill(model, p.context)
    prefill_s = {"agnostic": time.perf_counter() - t0}
    bases = {"agnostic": (context, p.question + p.suffix)}
    if any(QUESTION_MODES[m][0] == "aware" for m in modes) and p.question:
        t0 = time.perf_counter()
        bases["aware"] = (prefill(model, p.question, past=context), p.suffix)
        prefill_s["aware"] = prefill_s["agnostic"] + time.perf_counter() - t0
    turns_of = {}  # compression -> {turn number: modes whose rows it gives}
    for mode in modes:
        key = QUESTION_MODES[mode][0] if QUESTION_MODES[mode][0] in bases else "agnostic"
        for number in range(1, len(p.followups) + 2):
            if QUESTION_MODES[mode][1](number):
                turns_of.setdefault(key, {}).setdefault(number, []).append(mode)
    rows = []
    for key, labelled in turns_of.items():
        base, tail = bases[key]
        caches, compress_s, stats = [], [], []
        for variant in variants:
            t0 = time.perf_counter()
            caches.append(compress(model, base, variant))
            compress_s.append(time.perf_counter() - t0)
            stats.append(cache_stats(caches[-1], variant, base.length))
        turns = [(tail, sample.gold)]
        for turn in p.followups:
            turns.append((turns[-1][0] + turn.ids, turn.gold))
        for number, (turn_tail, gold) in enumerate(turns, start=1):
            if number not in labelled:
                continue
            div, first = [{} for _ in variants], [None] * len(variants)
            if sample.metric != "none" and not (p.reference and number == 1):  # KL along the full cache's answer
                run = verified_decode(model, caches, ref, turn_tail, base.length, max_new_tokens)
                decoded, decode_s, tf_s, first = run.answers, run.decode_s, run.teacher_forced_s, run.first
                if kl and decoded[ref]:
                    div = divergence(run.logp, decoded[ref], ref)
            else:  # KL along the sample's reference text (prose), and answers (if any) decoded by every row
                t0 = time.perf_counter()
                decoded = greedy_decode(model, caches, turn_tail, base.length, max_new_tokens) if sample.metric != "none" else [[] for _ in variants]
                decode_s = time.perf_counter() - t0
                t0 = time.perf_counter()
                if kl and p.reference:
                    div = divergence(teacher_forced(model, caches, turn_tail, p.reference, base.length)[0], p.reference, ref)
                tf_s = time.perf_counter() - t0
            for i, variant in enumerate(variants):
                prediction = tokenizer.decode(decoded[i], skip_special_tokens=True)
                row = {
                    **sample.row(),
                    "method": variant.method,
                    "method_kind": variant.kind,
                    "press": variant.params.get("press"),
                    "wrapper": variant.params.get("wrapper"),
                    "press_kwargs": json.dumps(variant.params["kwargs"], sort_keys=True) if "press" in variant.params else None,
                    "layer_budgets": "layer_budgets" in variant.params,  # per-layer budgets from calibration
                    **variant.storage,
                    "budget": variant.budget,
                    "turn": number,
                    "gold": list(gold),
                    "compressed_tokens": base.length,
                    "prediction": prediction,
                    "score": score(sample.metric, prediction, gold),
                    **stats[i],
                    **div[i],
                    "prefill_s": prefill_s[key],
                    "compress_s": compress_s[i],
                    "decode_s": decode_s,
                    "decode_batch": len(variants),
                    "teacher_forced_s": tf_s,
                    "new_tokens": len(decoded[i]),
                    # where the row's greedy choice first left the full cache's answer (None: never, so its
                    # answer is the full cache's; on the full row itself, a near-tie between its parallel and
                    # its step-by-step pass: the numerical noise floor)
                    "diverged_at": first[i],
                }
                rows += [{**row, "question_mode": mode} for mode in labelled[number]]
    return rows
