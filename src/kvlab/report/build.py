"""results/report.html: one self-contained page from results/kvlab.duckdb.

Charts are Altair specs rendered to inline SVG with vl-convert, so the page needs no script and no
network. Every table and chart comes from a named query in queries.sql, shown under it.
"""

from __future__ import annotations

import html
import json
import numbers
import re
from importlib.resources import files
from pathlib import Path

import altair as alt
import duckdb
import pandas as pd
import vl_convert

from kvlab.io import atomic_path
from kvlab.report.decision import KL_SAFE, TARGET, TOLERANCE_POINTS, article_comparison, c12_verdict, decision_table

alt.data_transformers.disable_max_rows()  # charts are rendered here to static SVG, not shipped as data to a browser



def load_queries() -> dict[str, str]:
    text = files("kvlab.report").joinpath("queries.sql").read_text()
    blocks = re.split(r"^-- name: (\w+)\n", text, flags=re.M)[1:]
    return {name: sql.strip() for name, sql in zip(blocks[::2], blocks[1::2])}


def esc(value) -> str:
    return html.escape(str(value), quote=True)


def cell(value) -> str:
    """One table cell: blank for missing, thousands separators for counts and large numbers."""
    if pd.api.types.is_scalar(value) and pd.isna(value):
        text = ""
    elif isinstance(value, numbers.Integral):
        text = f"{int(value):,}"
    elif isinstance(value, numbers.Real):
        text = f"{value:,.0f}" if abs(value) >= 1e4 else f"{value:,.4g}"
    else:
        text = str(value)
    long = isinstance(value, str) and len(value) > 40
    return f"<td class='long'>{esc(text)}</td>" if long else f"<td>{esc(text)}</td>"


def table(frame: pd.DataFrame) -> str:
    head = "".join(f"<th>{esc(c)}</th>" for c in frame.columns)
    body = "".join("<tr>" + "".join(cell(v) for v in row) + "</tr>" for row in frame.itertuples(index=False))
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def svg(chart: alt.TopLevelMixin) -> str:
    return vl_convert.vegalite_to_svg(chart.to_dict())


def accuracy_chart(acc: pd.DataFrame) -> alt.TopLevelMixin:
    """Accuracy vs KV bytes stored (fraction of the full bf16 cache, log scale), one line per method
    (evicting methods across their budgets; quantized ones a point each), one panel per task shape and
    question mode; the full cache is the point at 1."""
    data = acc.assign(kv=acc["kv_fraction_bf16"].clip(lower=1e-3))
    return alt.Chart(data).mark_line(point=True).encode(
        x=alt.X("kv:Q", title="KV bytes stored / full cache in bf16", scale=alt.Scale(type="log", domain=[0.02, 1])),
        y=alt.Y("accuracy:Q", title="accuracy", scale=alt.Scale(domain=[0, 1])),
        color=alt.Color("method:N", title="method", scale=alt.Scale(scheme="tableau20")), order="kv:Q",
        tooltip=["method", "budget", "accuracy", "kv_fraction_bf16", "rows"],
    ).properties(width=230, height=160).facet(
        row=alt.Row("shape:N", title=None), column=alt.Column("question_mode:N", title=None)
    )


C1_FACTOR = 2.0  # C1 holds when keys' median outlier score is at least this multiple of values'
C2_MASSIVE = 10.0  # C2: token 0's residual magnitude at least this multiple of every other position's …
C2_MASS = 0.30  # … and at least this share of attention on token 0 in some layer


def calibration_charts(q: dict) -> str:
    """Heatmaps of channel magnitude, massive activations, token-0 attention and concentration by layer."""
    channels = alt.Chart(q["calib_channels"]).mark_rect().encode(
        x=alt.X("channel:O", title="KV head × channel", axis=None),
        y=alt.Y("layer:O", title="layer"),
        color=alt.Color("absmax:Q", scale=alt.Scale(type="log", scheme="viridis"), title="|x| max"),
    ).properties(width=220, height=160).facet(
        row=alt.Row("model:N", title=None), column=alt.Column("tensor:N", title=None, sort=["key_pre_rope", "key_post_rope", "value"])
    ).resolve_scale(x="independent", y="independent")
    massive = alt.Chart(q["calib_massive"]).mark_line(point=True).encode(
        x=alt.X("layer:Q"), y=alt.Y("max_abs:Q", scale=alt.Scale(type="log"), title="largest |hidden| entering the layer"),
        color=alt.Color("position_class:N", title="positions"), tooltip=["layer", "position_class", "max_abs", "token", "channel"],
    ).properties(width=300, height=180).facet(column=alt.Column("model:N", title=None)).resolve_scale(x="independent")
    sinks = alt.Chart(q["calib_sinks"]).mark_rect().encode(
        x=alt.X("head:O", title="query head"), y=alt.Y("layer:O"),
        color=alt.Color("token0_mass:Q", scale=alt.Scale(domain=[0, 1], scheme="orangered"), title="mass on token 0"),
    ).properties(width=200, height=180).facet(column=alt.Column("model:N", title=None)).resolve_scale(x="independent", y="independent")
    conc = alt.Chart(q["calib_concentration"]).transform_fold(
        ["token0_mass", "keys90_fraction"], as_=["measure", "value"]
    ).mark_line(point=True).encode(
        x="layer:Q", y=alt.Y("value:Q", title="fraction", scale=alt.Scale(domain=[0, 1])), color=alt.Color("measure:N", title=None),
    ).properties(width=300, height=180).facet(column=alt.Column("model:N", title=None)).resolve_scale(x="independent")
    return (
        "<h3>Channel magnitude: keys before and after RoPE, values</h3>" + svg(channels)
        + "<h3>Massive activations: the residual stream entering each layer</h3>" + svg(massive)
        + "<h3>Attention on token 0, by layer and query head</h3>" + svg(sinks)
        + "<h3>Attention concentration by layer</h3>"
        + "<p class='note'>keys90_fraction: share of the visible keys that hold 90% of a query's attention "
        "(mean over heads, query positions and sequences); token0_mass: attention on token 0.</p>" + svg(conc)
    )


def calibration_verdicts(c1: pd.DataFrame, c2: pd.DataFrame) -> list[tuple[str, str, str]]:
    """(claim, verdict, evidence) for C1 and C2, one per calibrated model."""
    out = []
    for r in c1.itertuples():
        holds = r.key_pre_rope >= C1_FACTOR * r.value
        out.append((
            f"C1 (key channel outliers ≫ value) on {r.model}", "holds" if holds else "does not hold",
            f"median outlier score per head (largest channel / median channel) {r.key_pre_rope:.2f}× for keys before "
            f"RoPE, {r.key_post_rope:.2f}× after, {r.value:.2f}× for values (ratio {r.key_pre_rope / r.value:.2f}; "
            f"largest head: keys {r.key_pre_rope_max:.1f}×, values {r.value_max:.1f}×). Rule: keys ≥ {C1_FACTOR:g}× values.",
        ))
    for r in c2.itertuples():
        holds = r.massive_ratio >= C2_MASSIVE and r.token0_mass_max >= C2_MASS
        out.append((
            f"C2 (massive activation and attention sink on token 0) on {r.model}", "holds" if holds else "does not hold",
            f"token 0's residual magnitude reaches {r.token0_max_abs:,.4g}, "
            f"{r.massive_ratio:.0f}× every other position (layer {r.massive_layer}); token 0 takes {r.token0_mass_max:.0%} "
            f"of attention in layer {r.token0_mass_layer} and {r.token0_mass_mean:.0%} on average over layers. "
            f"Rule: ≥ {C2_MASSIVE:g}× and ≥ {C2_MASS:.0%} in some layer.",
        ))
    return out


def verdict_list(verdicts: list[tuple[str, str, str]]) -> str:
    return "<ul>" + "".join(f"<li><b>{esc(c)}: {esc(v)}</b> — {esc(e)}</li>" for c, v, e in verdicts) + "</ul>"


UNITS = {"KB": (1024, 1000), "MB": (1024**2, 1e6), "GB": (1024**3, 1e9)}  # the article's units, binary or decimal


def _matches(printed: str, exact: float) -> bool:
    """Whether `printed` (e.g. '12.5 GB + 40 MB', '≈3.1 GB', '320 KB/token') gives `exact` bytes' first term to
    its printed precision, reading the unit as binary or decimal ('≈' allows one unit in the last digit)."""
    m = re.search(r"([\d.]+)\s*(KB|MB|GB)", printed)
    if m is None:
        return False
    value, unit = m.group(1), m.group(2)
    decimals = len(value.split(".")[1]) if "." in value else 0
    slack = 10 ** -decimals if "≈" in printed else 0
    return any(abs(round(exact / base, decimals) - float(value)) <= slack + 1e-9 for base in UNITS[unit])


def cost_verdict(costs: pd.DataFrame) -> tuple[str, str, str]:
    """C9: each printed figure of the article's cost table against our accounting (its own convention: the
    `article_view` total, per-token bytes), read in binary or decimal units."""
    claim = "C9 cost table exact"
    rows = costs[costs["article_printed"].notna()]
    if rows.empty:
        return claim, "not measured", "no article rows in the cost table"
    off = []
    for r in rows.itertuples():
        if not _matches(r.article_printed, r.article_view):
            off.append(f"{r.model} {r.scheme}: printed {r.article_printed}, computed {r.total_human} ({r.article_view / 1e9:.2f} GB decimal)")
        if isinstance(r.article_printed_per_token, str) and not _matches(r.article_printed_per_token, r.bytes_per_token):
            off.append(f"{r.model} {r.scheme}: printed {r.article_printed_per_token}, computed {r.bytes_per_token:,} B/token")
    n = len(rows) + int(rows["article_printed_per_token"].notna().sum())
    evidence = f"{n - len(off)} of {n} printed figures reproduced to their printed precision"
    return claim, "holds" if not off else "does not hold", evidence + (": off — " + "; ".join(off) if off else "") + "."


C3_KL = 0.01  # C3 holds when FP8's mean per-token KL on prose is at most this (the order of 1e-3 nat)
C4_HOLDS_KL = 0.2  # C4: 2-bit KIVI with per-channel keys stays at or below this KL …
C4_COLLAPSE_KL = 1.0  # … while per-token keys reach at least this KL
C5_POINTS = 1.0  # C5: INT4 pooled accuracy within this many points of the full cache
C10_RATIO, C10_SLACK = 3.2, 0.1  # C10: INT4's codes + metadata give 3.2× (± slack) over bf16, not 4×


def _series(frame: pd.DataFrame) -> pd.Series:
    """A label per storage layout: the scheme, with KIVI's axes when they are not KIVI's own."""
    def label(r) -> str:
        if r.scheme == "kivi" and (r.key_axis, r.value_axis) != ("channel", "token"):
            return f"kivi (keys per {r.key_axis}, values per {r.value_axis})"
        return str(r.scheme)
    return frame.apply(label, axis=1)


def kl_bits_chart(kl: pd.DataFrame) -> alt.TopLevelMixin:
    """Per-token KL vs bits per element, one line per scheme, one panel per prefix length (no eviction)."""
    data = kl[kl["budget"] == 1].assign(series=_series(kl[kl["budget"] == 1]), kl=lambda f: f["kl_mean_nats"].clip(lower=1e-6))
    return alt.Chart(data).mark_line(point=True).encode(
        x=alt.X("bits:Q", title="bits per element", scale=alt.Scale(type="log", base=2, domain=[2, 8])),
        y=alt.Y("kl:Q", title="mean per-token KL vs full (nats)", scale=alt.Scale(type="log")),
        color=alt.Color("series:N", title="scheme"), tooltip=["method", "bits", "kl_mean_nats", "delta_ppl"],
    ).properties(width=320, height=220).facet(column=alt.Column("context_tokens:O", title="prefix tokens"))


STORAGE = ["model", "method", "scheme", "bits", "key_axis", "value_axis", "budget"]


def pooled(by_task: pd.DataFrame, common_tasks: bool = False) -> pd.DataFrame:
    """Accuracy per method over the tasks it ran on (all answers pooled) — or, with `common_tasks`, over the
    tasks every method in `by_task` ran on, so methods limited to some tasks compare on equal ground."""
    if by_task.empty:
        return pd.DataFrame(columns=[*STORAGE, "accuracy", "full_accuracy", "delta_points", "rows", "tasks"])
    if common_tasks:
        keep = set.intersection(*(set(g["task"]) for _, g in by_task.groupby("method")))
        by_task = by_task[by_task["task"].isin(keep)]
    g = by_task.groupby(STORAGE, dropna=False).agg(
        correct=("correct", "sum"), full_correct=("full_correct", "sum"), rows=("rows", "sum"),
        tasks=("task", lambda t: ", ".join(sorted(t))),
    ).reset_index()
    g["accuracy"], g["full_accuracy"] = g["correct"] / g["rows"], g["full_correct"] / g["rows"]
    g["delta_points"] = 100 * (g["accuracy"] - g["full_accuracy"])
    return g[[*STORAGE, "accuracy", "full_accuracy", "delta_points", "rows", "tasks"]]


def ablation_table(kl: pd.DataFrame, by_task: pd.DataFrame) -> pd.DataFrame:
    """The article's KIVI table shape: 2-bit KIVI by key axis × value axis, KL per prefix and accuracy on the
    tasks all four ran on."""
    two = kl[(kl["scheme"] == "kivi") & (kl["bits"] == 2) & (kl["budget"] == 1)]
    if two.empty:
        return pd.DataFrame()
    out = two.pivot_table(index=["model", "key_axis", "value_axis"], columns="context_tokens", values="kl_mean_nats")
    out.columns = [f"KL @ {c} tokens" for c in out.columns]
    a = pooled(by_task[(by_task["scheme"] == "kivi") & (by_task["bits"] == 2) & (by_task["budget"] == 1)], common_tasks=True)
    a = a.set_index(["model", "key_axis", "value_axis"])[["accuracy", "full_accuracy", "delta_points", "tasks"]]
    return out.join(a).reset_index().rename(columns={"key_axis": "keys per", "value_axis": "values per"})


def _one(frame: pd.DataFrame, **where) -> pd.DataFrame:
    for key, value in where.items():
        frame = frame[frame[key] == value]
    return frame


def quant_verdicts(kl: pd.DataFrame, acc: pd.DataFrame) -> list[tuple[str, str, str]]:
    """(claim, verdict, evidence) for C3, C4, C5 and C10 from the quant_kl table and pooled accuracy."""
    out = []
    kl = kl[kl["budget"] == 1]
    acc = acc[acc["budget"] == 1]
    fp8 = _one(kl, scheme="fp8")
    if fp8.empty:
        out.append(("C3 FP8 KL ≈ 1e-3 nat", "not measured", "no fp8 method in this run"))
    else:
        worst = fp8["kl_mean_nats"].max()
        each = "; ".join(f"{r.method} {r.kl_mean_nats:.2g} nat at {r.context_tokens} tokens" for r in fp8.itertuples())
        out.append(("C3 FP8 KL ≈ 1e-3 nat", "holds" if worst <= C3_KL else "does not hold", f"{each}. Rule: ≤ {C3_KL:g} nat."))
    chan = _one(kl, scheme="kivi", bits=2, key_axis="channel", value_axis="token")
    tok = _one(kl, scheme="kivi", bits=2, key_axis="token", value_axis="token")
    if chan.empty or tok.empty:
        out.append(("C4 2-bit: per-token keys collapse, per-channel hold", "not measured", "needs 2-bit kivi with key_axis channel and token"))
    else:
        c, t = chan["kl_mean_nats"].max(), tok["kl_mean_nats"].min()
        verdict = "holds" if c <= C4_HOLDS_KL and t >= C4_COLLAPSE_KL else "does not hold"
        out.append(("C4 2-bit: per-token keys collapse, per-channel hold", verdict,
                    f"keys per channel: KL up to {c:.3g} nat; keys per token: at least {t:.3g} nat ({t / c:.0f}×). "
                    f"Rule: per channel ≤ {C4_HOLDS_KL:g}, per token ≥ {C4_COLLAPSE_KL:g} nat."))
    int4 = _one(acc, scheme="kivi", bits=4, key_axis="channel", value_axis="token")
    if int4.empty:
        out.append(("C5 INT4 within 1 point", "not measured", "no 4-bit kivi method scored on tasks"))
    else:
        r = int4.iloc[0]
        verdict = "holds" if abs(r.delta_points) <= C5_POINTS else "does not hold"
        out.append(("C5 INT4 within 1 point", verdict,
                    f"{r.method}: {r.accuracy:.1%} vs full {r.full_accuracy:.1%} over {r.rows} scored answers ({r.tasks}; "
                    f"question modes and turns pooled), {r.delta_points:+.1f} points. Rule: |Δ| ≤ {C5_POINTS:g} point."))
    int4kl = _one(kl, scheme="kivi", bits=4, key_axis="channel", value_axis="token")
    if int4kl.empty:
        out.append(("C10 INT4 real compression ≈ 3.2×", "not measured", "no 4-bit kivi method on prose"))
    else:
        r = int4kl.iloc[0]
        verdict = "holds" if abs(r.codes_vs_bf16 - C10_RATIO) <= C10_SLACK else "does not hold"
        out.append(("C10 INT4 real compression ≈ 3.2×", verdict,
                    f"{r.method}: stored codes + metadata give {r.codes_vs_bf16:.3f}× over bf16 for the quantized tokens "
                    f"(measured from the tensors); the whole cache at {r.context_tokens} tokens, with its full-precision "
                    f"residual, {r.compression_vs_bf16:.2f}×. Rule: {C10_RATIO:g} ± {C10_SLACK:g}."))
    return out


def quant_section(kl: pd.DataFrame, by_task: pd.DataFrame) -> str:
    if kl.empty and by_task.empty:
        return "<p>No quantized cache was configured in this run.</p>"
    acc = pooled(by_task)
    items = verdict_list(quant_verdicts(kl, acc))
    hf = _one(kl, scheme="hf_quanto", budget=1.0)
    ours = _one(kl, scheme="kivi", key_axis="channel", value_axis="token", budget=1.0)
    versus = ours.merge(hf, on=["model", "bits", "context_tokens"], suffixes=("", "_hf"))
    baseline = ""
    if not versus.empty:
        versus = versus.assign(times_lower=versus["kl_mean_nats_hf"] / versus["kl_mean_nats"])[
            ["model", "bits", "context_tokens", "method", "kl_mean_nats", "method_hf", "kl_mean_nats_hf", "times_lower"]]
        baseline = "<h3>Against transformers' QuantizedCache (same bits, G and R)</h3>" + table(versus)
    ablation = ablation_table(kl, by_task)
    return (
        "<p>Packed codes inside generation: prefill attention is exact, then each full-attention layer keeps "
        "codes + metadata + a full-precision residual (KIVI: the newest R tokens; a key group is quantized once, "
        "when its G tokens are complete). FP8 and INT8 keep no residual unless one is configured: every token, "
        "decoded ones included, is stored quantized, as a deployed FP8 cache does. The continuation of real prose is fed one token at a "
        "time, so every token attends to the cache as it is stored. Sliding-window layers (Gemma 3) are never "
        "quantized.</p>"
        + items + (svg(kl_bits_chart(kl)) if not kl.empty else "") + table(kl)
        + ("<h3>2-bit ablation (KIVI's table shape)</h3>" + table(ablation) if not ablation.empty else "")
        + baseline + "<h3>Accuracy on the scored tasks</h3><p class='note'>All answers of the tasks each method ran "
        "on, pooled (a method limited by its `tasks` list is scored on those only).</p>" + table(acc)
    )


C6_BUDGET = 0.25  # C6 and C7 are judged at the article's 25% budget
FAIL_SHARE = 0.5  # "fails": at most this share of the full cache's accuracy on the same samples
WINDOW_MARGIN = 0.05  # C8: a needle counts as outside the kept window when its distance from the end, as a
# fraction of the document, exceeds the budget by this margin (depth is measured in sentences, not tokens)
C8_COLLAPSE = 2.0  # C8: without sinks, prose KL at least this multiple of the KL with sinks at the same budget


def _plain(frame: pd.DataFrame, press: str) -> pd.DataFrame:
    """Rows of a kvpress press used alone (no wrapper)."""
    return frame[(frame["press"] == press) & frame["wrapper"].isna()]


def _n_sink(frame: pd.DataFrame) -> pd.Series:
    return frame["press_kwargs"].map(lambda k: json.loads(k).get("n_sink") if isinstance(k, str) else None)


def _score(frame: pd.DataFrame) -> tuple[float, float, int]:
    """Accuracy and the full cache's accuracy on the same answers, weighted by rows; and the row count."""
    n = frame["rows"].sum()
    return (frame["accuracy"] * frame["rows"]).sum() / n, (frame["full_accuracy"] * frame["rows"]).sum() / n, int(n)


def _passes(acc: float, full: float) -> bool:
    return full > 0 and acc >= full - TOLERANCE_POINTS / 100


def _fails(acc: float, full: float) -> bool:
    return full > 0 and acc <= FAIL_SHARE * full


def _says(label: str, frame: pd.DataFrame) -> str:
    a, f, n = _score(frame)
    return f"{label} {a:.0%} (full {f:.0%}, {n} answers)"


def _verdict(holds: bool, full_accuracies: list[float]) -> str:
    """A claim about losing what the full cache finds cannot be judged where the full cache finds nothing."""
    if min(full_accuracies) == 0:
        return "not measured (the full cache scores 0% on these samples)"
    return "holds" if holds else "does not hold"


def eviction_verdicts(acc: pd.DataFrame, kl: pd.DataFrame) -> list[tuple[str, str, str]]:
    """(claim, verdict, evidence) for C6, C7, C8 and C11 from the eviction_accuracy and eviction_kl tables."""
    out = []
    needle = acc[acc["shape"] == "single needle"]
    snap = _plain(acc, "SnapKVPress")
    snap25 = snap[snap["budget"] == C6_BUDGET]
    parts = {
        "question-aware": snap25[(snap25["shape"] == "single needle") & (snap25["question_mode"] == "aware")],
        "question-agnostic": snap25[(snap25["shape"] == "single needle") & (snap25["question_mode"] == "agnostic")],
        "second turn": snap25[(snap25["shape"] == "multi-turn") & (snap25["question_mode"] == "multi_turn")],
    }
    c6 = f"C6 SnapKV {C6_BUDGET:.0%}: passes the needle question-aware, fails agnostic and on the second turn"
    missing = [k for k, v in parts.items() if v.empty]
    if missing:
        out.append((c6, "not measured", f"no SnapKV rows at {C6_BUDGET:g} for: {', '.join(missing)}"))
    else:
        s = {k: _score(v) for k, v in parts.items()}
        holds = _passes(*s["question-aware"][:2]) and _fails(*s["question-agnostic"][:2]) and _fails(*s["second turn"][:2])
        out.append((c6, _verdict(holds, [v[1] for v in s.values()]),
                    "; ".join(_says(k, v) for k, v in parts.items())
                    + f". Rule: aware within {TOLERANCE_POINTS:g} point of full; agnostic and second turn at most "
                    f"{FAIL_SHARE:.0%} of full."))
    h2o = needle[(needle["method_kind"] == "h2o") & (needle["budget"] == C6_BUDGET)]
    c7 = "C7 H2O fails the needle"
    if h2o.empty:
        out.append((c7, "not measured", f"no H2O rows on a single needle at {C6_BUDGET:g}"))
    else:
        modes = {m: g for m, g in h2o.groupby("question_mode")}
        holds = all(_fails(*_score(g)[:2]) for g in modes.values())
        out.append((c7, _verdict(holds, [_score(g)[1] for g in modes.values()]),
                    "; ".join(_says(f"{m} at {C6_BUDGET:g}", g) for m, g in modes.items())
                    + f". Rule: at most {FAIL_SHARE:.0%} of full in every question mode."))
    stream = _plain(acc[acc["shape"].isin(["single needle", "recency"]) & acc["depth"].notna()], "StreamingLLMPress")
    stream = stream[_n_sink(stream).fillna(0) > 0]
    distance = 1 - stream["depth"]
    outside, inside = stream[distance > stream["budget"] + WINDOW_MARGIN], stream[distance < stream["budget"] - WINDOW_MARGIN]
    streams = _plain(kl, "StreamingLLMPress").assign(n_sink=lambda f: _n_sink(f))
    pairs = streams[streams["n_sink"] == 0].merge(
        streams[streams["n_sink"] > 0], on=["model", "budget", "context_tokens"], suffixes=("_0", "_sinks"))
    c8 = "C8 StreamingLLM fails outside its window and collapses without sinks"
    if outside.empty or pairs.empty:
        what = "needles outside the window" if outside.empty else "prose KL with n_sink 0 and with sinks"
        out.append((c8, "not measured", f"no StreamingLLM rows for {what}"))
    else:
        ratio = pairs["kl_mean_nats_0"] / pairs["kl_mean_nats_sinks"]
        holds = _fails(*_score(outside)[:2]) and bool((ratio >= C8_COLLAPSE).all())
        each = "; ".join(f"{r.budget:g} at {r.context_tokens} tokens: {r.kl_mean_nats_0:.3g} vs {r.kl_mean_nats_sinks:.3g} nat"
                         for r in pairs.itertuples())
        out.append((c8, _verdict(holds, [_score(outside)[1]]),
                    _says("needle outside the kept window", outside)
                    + ("; " + _says("inside", inside) if not inside.empty else "")
                    + f". Prose KL without sinks vs with {int(pairs['n_sink_sinks'].iloc[0])}: {each}. Rule: outside at most "
                    f"{FAIL_SHARE:.0%} of full; KL without sinks ≥ {C8_COLLAPSE:g}× at every budget."))
    pyr, snp = _plain(acc, "PyramidKVPress"), snap
    keys = ["model", "shape", "question_mode", "budget", "depth"]
    both = pyr.merge(snp, on=keys, suffixes=("_p", "_s"))
    c11 = "C11 PyramidKV ≥ SnapKV at equal total budget"
    if both.empty:
        out.append((c11, "not measured", "needs PyramidKV and SnapKV on the same tasks"))
    else:
        per = []
        for budget, g in both.groupby("budget", sort=False):
            n = g["rows_p"].sum()
            per.append((budget, (g["accuracy_p"] * g["rows_p"]).sum() / n, (g["accuracy_s"] * g["rows_s"]).sum() / g["rows_s"].sum(), n))
        holds = all(p >= q - TOLERANCE_POINTS / 100 for _, p, q, _ in per)
        full = (both["full_accuracy_p"] * both["rows_p"]).sum() / both["rows_p"].sum()
        out.append((c11, _verdict(holds, [full]),
                    "; ".join(f"{b:g}: PyramidKV {p:.1%} vs SnapKV {q:.1%} ({n} answers each)" for b, p, q, n in per)
                    + f" (every scored task shape and question mode both ran). Rule: PyramidKV ≥ SnapKV − "
                    f"{TOLERANCE_POINTS:g} point at every budget."))
    return out


def eviction_section(acc: pd.DataFrame, kl: pd.DataFrame) -> str:
    if acc.empty and kl.empty:
        return "<p>No eviction method was configured in this run.</p>"
    items = verdict_list(eviction_verdicts(acc, kl))
    masking = acc[acc["kept_tokens"] < acc["stored_tokens"] - 0.5]
    note = ""
    if not masking.empty:
        names = ", ".join(sorted(masking["method"].unique()))
        note = (f"<p class='note'>{esc(names)}: the press masks evicted keys per head and frees nothing — "
                "stored tokens stay the prompt's, attended tokens drop to the budget (see the bytes section).</p>")
    pooled_modes = acc.groupby(["model", "shape", "question_mode", "method", "budget"], sort=False).apply(
        lambda g: pd.Series(dict(zip(["accuracy", "full_accuracy", "rows"], _score(g)))),
        include_groups=False,
    ).reset_index()
    return (
        "<p>Eviction compresses once, after the prompt part is prefilled (question-agnostic: the context alone; "
        "aware: context and question; multi_turn: the aware cache asked a later question about another needle). "
        "H2O also evicts at every decoding step. Positions: kept keys keep their rotation and decoding continues "
        "at the prompt's length, except for methods wrapped in KeyRerotationPress (StreamingLLM's own scheme: "
        "keys re-rotated to 0…n−1, decoding from n). Sliding-window layers (Gemma 3) are never compressed.</p>"
        + items + note + table(pooled_modes) + "<h3>On real prose</h3>" + table(kl)
    )


CLAIM_QUERIES = {1: "calib_c1", 2: "calib_c2", 3: "quant_kl", 4: "quant_kl", 5: "quant_accuracy", 6: "eviction_accuracy",
                 7: "eviction_accuracy", 8: "eviction_accuracy, eviction_kl", 9: "cost_article", 10: "quant_kl",
                 11: "eviction_accuracy", 12: "decision"}  # claim number -> the queries (queries.sql) its verdict reads


def claims(q: dict) -> pd.DataFrame:
    """Every claim's verdict, C1 to C12 in order, with the queries behind it."""
    out = calibration_verdicts(q["calib_c1"], q["calib_c2"])
    out += quant_verdicts(q["quant_kl"], pooled(q["quant_accuracy"]))
    out += eviction_verdicts(q["eviction_accuracy"], q["eviction_kl"])
    out.append(cost_verdict(q["cost_article"]))
    out.append(("C12 the decision table, regenerated from this run", *c12_verdict(article_comparison(q["decision"]))))
    number = [int(re.match(r"C(\d+)", c[0]).group(1)) for c in out]
    frame = pd.DataFrame(out, columns=["claim", "verdict", "evidence"]).assign(query=[CLAIM_QUERIES[n] for n in number], n=number)
    return frame.sort_values("n", kind="stable").drop(columns="n")


def throughput_chart(speed: pd.DataFrame) -> alt.TopLevelMixin:
    """Decode tokens/s vs context length, one line per method at each budget, one panel per device and batch."""
    data = speed.assign(variant=speed["method"] + speed["budget"].map(lambda b: f"@{b:g}" if b < 1 else ""))
    return alt.Chart(data).mark_line(point=True).encode(
        x=alt.X("context_tokens:Q", title="context tokens", scale=alt.Scale(type="log", base=2)),
        y=alt.Y("tokens_per_s:Q", title="decode tokens / s (all sequences)"),
        color=alt.Color("variant:N", title="method"),
        tooltip=["variant", "context_tokens", "batch", "tokens_per_s", "kv_bytes"],
    ).properties(width=420, height=240).facet(column=alt.Column("device:N", title="device"), row=alt.Row("batch:O", title="batch"))


def kernel_charts(rows: pd.DataFrame) -> str:
    """Decode-attention time and bandwidth vs context, one line per format and path, one panel per batch."""
    data = rows.assign(variant=rows["format"] + " · " + rows["path"])
    base = alt.Chart(data).mark_line(point=True).encode(
        x=alt.X("context_tokens:Q", title="context tokens", scale=alt.Scale(type="log", base=2)),
        color=alt.Color("variant:N", title="format · path"),
        tooltip=["variant", "context_tokens", "batch", "ms", "call_ms", "gb_per_s", "speedup_vs_sdpa"],
    ).properties(width=300, height=200)
    time = base.encode(y=alt.Y("ms:Q", title="ms per call on the device", scale=alt.Scale(type="log"))).facet(column=alt.Column("batch:O", title="batch"))
    bandwidth = base.encode(y=alt.Y("gb_per_s:Q", title="GB/s (bytes the path must read)")).facet(column=alt.Column("batch:O", title="batch"))
    return svg(time) + svg(bandwidth)


def kernel_section(rows: pd.DataFrame) -> str:
    intro = (
        "<p>One decode step of one layer: a query token per sequence against a cache of N tokens with the model's "
        "head shape (or the configured one), timed on the device (median of repeated calls, each after a 256 MB "
        "write that evicts the cache from L2, so every path reads from device memory). <b>ms</b> is the device's "
        "time: the call replayed from a CUDA graph, with no Python or launch latency; <b>call_ms</b> is the call "
        "made from Python, which also pays the host's work where it outlasts the kernels. <b>sdpa</b>: torch's "
        "SDPA on the dense cache; <b>flash</b>: FlashAttention, when installed; <b>triton</b>: kvlab's kernel reading "
        "the packed codes (FP8 E4M3 from sm_89 on, KIVI INT4/INT2 with the configured group and residual) and "
        "dequantizing in registers; <b>dequantize</b>: the same codes rebuilt in full precision, then SDPA — what transformers' and "
        "kvpress's quantized caches do at every step. Bandwidth counts the bytes each path must read: the cache as "
        "stored (codes, scales, zero points, residual), the query and the output.</p>"
    )
    if rows.empty:
        return intro + ("<p><b>Not measured in this run</b>: the kernel benchmark runs when config.yaml sets "
                        "<code>device: cuda</code> (without a GPU, Triton only interprets its kernels).</p>")
    return intro + kernel_charts(rows) + table(rows)


def decision_section(dec: pd.DataFrame) -> str:
    if dec.empty:
        return "<p>No compressed method was evaluated in this run.</p>"
    return (
        f"<p><b>Rule:</b> a method is safe at a budget when its accuracy is within {TOLERANCE_POINTS:g} point of the "
        f"full cache on the same answers (turns and tasks of a shape pooled), or, on prose with no answers to score, "
        f"when its per-token KL to the full cache is at most {KL_SAFE:g} nat. Each safe method appears once, at its "
        f"most compressed safe budget, with the compression it reached (bytes stored vs the full cache in bf16, "
        f"measured). The article's question — 40 GB → 10 GB — asks for ≥ {TARGET:g}×.</p>"
        + table(decision_table(dec))
        + "<h3>Against the article's decision table</h3><p class='note'>Each recommendation of the article's "
        "table that this run can test, on the task shape that stands for its workload. Methods are recognized by "
        "what they store (INT4: 4-bit KIVI without eviction; FP8 + SnapKV 25%: FP8 storage of SnapKV's 25%), not by "
        "name. A 'safe' statement agrees when some such method is safe; a 'not safe' statement when none is.</p>"
        + table(article_comparison(dec))
    )


def section(title: str, body: str, sql: str | None = None) -> str:
    query = f"<details><summary>query</summary><pre>{esc(sql)}</pre></details>" if sql else ""
    return f"<section><h2>{esc(title)}</h2>{body}{query}</section>"


def summary(models: pd.DataFrame, acc: pd.DataFrame, dec: pd.DataFrame) -> str:
    """The grid in one sentence, then the article's question answered per task shape and question mode:
    which methods reach ≥ TARGET× fewer bytes than bf16 and stay safe (the decision table's rule)."""
    names = ", ".join(models["name"])
    grid = (
        f"tasks {', '.join(sorted(acc['task'].unique()))}; context {', '.join(map(str, sorted(acc['context_tokens'].unique())))} "
        f"tokens; methods {', '.join(sorted(acc['method'].unique()))}; budgets "
        f"{', '.join(f'{b:g}' for b in sorted(acc.loc[acc['budget'] < 1, 'budget'].unique(), reverse=True))} of the KV cache kept; "
        f"question modes "
        f"{', '.join(sorted(acc['question_mode'].unique()))}"
    )
    items = []
    for _, r in decision_table(dec).iterrows():
        where, safe, reach = f"{r['shape']} ({r['question mode']})", r["safe (most compression first)"], r[f"safe at ≥ {TARGET:g}×"]
        if safe.startswith("—"):
            items.append(f"<li>{esc(where)}: the full cache itself scores 0% — nothing to judge.</li>")
        elif reach != "none":
            items.append(f"<li>{esc(where)}: <b>{esc(reach)}</b></li>")
        else:
            best = f" (best safe: {safe.split(', ')[0]})" if safe != "none" else " (nothing safe at any budget)"
            items.append(f"<li>{esc(where)}: none at ≥ {TARGET:g}×{esc(best)}</li>")
    return (
        f"<p>Model(s): <b>{esc(names)}</b>. Grid: {esc(grid)}.</p>"
        f"<p><b>The article's question — 40 GB → 10 GB, which method is safe on which task?</b> On this run, the "
        f"methods that stored at most 1/{TARGET:g} of the full cache's bf16 bytes and stayed within "
        f"{TOLERANCE_POINTS:g} accuracy point of it (on prose: KL ≤ {KL_SAFE:g} nat), by task shape and question "
        f"mode (measured compression in brackets):</p><ul>{''.join(items)}</ul>"
        "<p class='note'>The decision table below gives every safe method; the claims table gives each of the "
        "study's claims its verdict.</p>"
    )


def safe_budgets(versus: pd.DataFrame) -> str:
    """One line per (model, task, context, question mode): for each method the smallest measured budget that
    stays within TOLERANCE_POINTS of the full cache."""
    rows = []
    for (model, task, ctx, mode), g in versus.groupby(["model", "task", "context_tokens", "question_mode"], sort=True):
        full = g["full_accuracy"].iloc[0]
        if full == 0:
            continue
        row = {"model": model, "task": task, "context": ctx, "question": mode, "full cache": f"{full:.0%}"}
        for method, m in g.groupby("method"):
            safe = m[m["delta_points"] >= -TOLERANCE_POINTS]
            row[method] = f"{safe['budget'].min():g}" if len(safe) else "not safe"
        rows.append(row)
    return (
        f"<p>Each method's column gives the smallest fraction of the KV cache it kept while staying within "
        f"{TOLERANCE_POINTS:g} accuracy point of the full cache on the same samples (1: a method that evicts "
        f"nothing; 'not safe': no measured budget did; tasks the full cache fails are left out).</p>"
        + table(pd.DataFrame(rows))
    )


TASK_NOTE = (
    "<p>Every sample is generated with a seed and fitted to its context length with the model's own tokenizer "
    "(chat template included). niah: needles in noise sentences or King James prose (multi-key: distractor "
    "needles; multi-value: every value of one key; multi-query: several keys; question first: the question "
    "before the document). recency: the needle in the last tokens. variable_tracking: chains of variable "
    "assignments (multi-hop). multi_turn: a second question about another needle on the cache compressed "
    "for the first (turn 2). common_words / frequent_words: aggregation over redundant input. arithmetic: "
    "short word problems, scored by the last number. continuation: true prose teacher-forced, KL only.</p>"
)

CSS = """
body{font-family:system-ui,sans-serif;max-width:1150px;margin:2em auto;padding:0 1em;color:#222}
table{display:block;overflow-x:auto;border-collapse:collapse;font-size:13px;margin:.5em 0}td,th{border:1px solid #ccc;padding:3px 7px;text-align:right}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}pre{background:#f7f7f7;padding:.6em;font-size:12px;overflow:auto}
details{margin:.3em 0 1em}td.long{text-align:left;min-width:28em;font-size:12px}section{margin-bottom:2em}.note{color:#555;font-size:13px}
"""


FIGURES = ("accuracy_vs_kv_bytes", "kl_vs_bits")  # the key figures also written as files (for snakemake --report)


def build(db_path: str | Path, out_path: str | Path, title: str, figures: dict[str, str | Path] | None = None) -> None:
    """Write the report page; with `figures` (name in FIGURES → path), also each key figure as an SVG file."""
    queries = load_queries()
    con = duckdb.connect(str(db_path), read_only=True)
    try:
        q = {name: con.execute(sql).df() for name, sql in queries.items()}
    finally:
        con.close()
    charts = {"accuracy_vs_kv_bytes": svg(accuracy_chart(q["accuracy_bytes"])), "kl_vs_bits": svg(kl_bits_chart(q["quant_kl"]))}
    prov = dict(zip(q["provenance"]["key"], q["provenance"]["value"]))
    parts = [
        f"<h1>{esc(title)}</h1>",
        f"<p class='note'>Generated from results/kvlab.duckdb · config {esc(prov.get('config_hash'))} · "
        f"preset {esc(prov.get('preset'))} · commit {esc(prov.get('git_commit', '')[:12])}</p>",
        section("Summary", summary(q["models"], q["accuracy"], q["decision"]), queries["decision"]),
        section("Claims", "<p>Each claim of the study with its verdict on this run, the number behind it and the "
                "rule used; `query` names the SQL (shown under the sections below) whose rows decide it.</p>" + table(claims(q))),
        section("Decision table (article §7.2), regenerated", decision_section(q["decision"]), queries["decision"]),
        section(
            "Accuracy vs KV bytes",
            charts["accuracy_vs_kv_bytes"]
            + "<p class='note'>x: bytes the method stored after compression over the full cache's bytes, both "
            "counted in bf16 (quantized codes and metadata as stored). Question agnostic: the context was compressed "
            "before the question was seen. Aware: the question was part of the compressed prompt (inside SnapKV's "
            "observation window). multi_turn: a later question on the cache compressed for the first.</p>"
            + "<h3>Smallest safe budget per task</h3>" + safe_budgets(q["versus_full"])
            + "<h3>Accuracy per task, method and budget</h3>" + table(q["accuracy"]),
            queries["accuracy_bytes"] + "\n\n" + queries["versus_full"] + "\n\n" + queries["accuracy"],
        ),
        section("Eviction: which tokens survive", eviction_section(q["eviction_accuracy"], q["eviction_kl"]),
                queries["eviction_accuracy"] + "\n\n" + queries["eviction_kl"]),
        section(
            "Calibration: what the cache and attention look like",
            "<p>Each model read prose the tasks never use (the last tenth of the King James Bible); one forward "
            "pass per sequence, attention weights computed for a subset of query positions.</p>"
            + verdict_list(calibration_verdicts(q["calib_c1"], q["calib_c2"])) + calibration_charts(q)
            + "<h3>Secondary sinks</h3><p class='note'>Positions other than token 0 that take at least the sink "
            "threshold of a layer's attention in some sequence (no rows: none found).</p>"
            + table(q["calib_secondary_sinks"])
            + "<h3>Handed to later stages</h3>" + table(q["calib_fed_forward"]),
            queries["calib_c1"] + "\n\n" + queries["calib_c2"],
        ),
        section("Quantized KV caches", quant_section(q["quant_kl"], q["quant_accuracy"]), queries["quant_kl"] + "\n\n" + queries["quant_accuracy"]),
        section(
            "Divergence from the full cache",
            "<p>Per-token KL(full ‖ method) in nats, averaged over the teacher-forced path, and the change in "
            "perplexity on it. On prose the path is the text's true continuation; on question tasks it is the "
            "full cache's own answer, so the KL says how far a method's next-token distribution drifts where "
            "the uncompressed model was going.</p>" + table(q["divergence"]),
            queries["divergence"],
        ),
        section(
            "Decode throughput",
            "<p>Greedy decoding after each method's compression (EOS ignored, so every method decodes "
            "the same number of steps), labelled with the device it ran on; a batch is that many copies of the "
            "compressed cache decoded together (<code>throughput.batches</code>), and tokens/s counts them all. "
            "On CUDA, <code>graph_tokens_per_s</code> times one decode step captured in a CUDA graph and replayed "
            "(every kernel launch and Python call taken out, as serving engines decode): what the device itself "
            "spends per step, where a small model's eager decoding is bound by the host. "
            "On a CPU with a small model, reading the weights dominates each step; "
            "fewer cached tokens matter more at long contexts, large batches and on accelerators. <code>decode_path</code> says how "
            "each quantized cache was read: <b>triton codes</b> (on CUDA, kvlab's kernel attends to the packed codes "
            "directly, see the next section) or <b>dequantize</b> (codes rebuilt in full precision at every step, "
            "as transformers' quantized caches do; the CPU path), which decodes slower than the full cache.</p>"
            + (svg(throughput_chart(q["throughput"])) if not q["throughput"].empty else "") + table(q["throughput"]),
            queries["throughput"],
        ),
        section("Decode attention kernel over packed codes", kernel_section(q["decode_kernels"]), queries["decode_kernels"]),
        section(
            "Engine vs kvpress pipeline",
            "<p>The same samples, variants and question modes. kvlab's engine prefills each sample once "
            "(the question-aware prefill continues the agnostic one), compresses a copy of the cache per variant "
            "and decodes all variants as one batch; kvpress's pipeline prefills, compresses and decodes once per "
            "variant and mode (aware: the question inside the compressed context). Both produce answers only "
            "here (the engine's teacher-forced KL pass is off). The agnostic-only columns compare that mode "
            "alone. Agreement is the fraction of identical answers; in the aware mode the pipeline tokenizes "
            "context and question as one string, so a token at their boundary may differ.</p>"
            + table(q["engine_vs_pipeline"]),
            queries["engine_vs_pipeline"],
        ),
        section(
            "Cost table (article §8, recomputed)",
            "<p>Bytes per token = 2 × layers × KV heads × head_dim × bytes per element, plus group metadata "
            "for integer schemes; the article's printed figure beside ours.</p>" + table(q["cost_article"]),
            queries["cost_article"],
        ),
        section("Cost table for the evaluated models", table(q["cost_models"]), queries["cost_models"]),
        section(
            "Measured cache bytes vs the formula",
            "<p>Bytes summed from the stored key/value tensors after compression, beside "
            "kvlab.kernels.accounting for the same token count and dtype.</p>" + table(q["bytes_measured"]),
            queries["bytes_measured"],
        ),
        section("Models", table(q["models"]), queries["models"]),
        section("Task suite", TASK_NOTE + table(q["tasks"]), queries["tasks"]),
        section("Provenance", table(q["provenance"]) + "<h3>Wall time per rule</h3>" + table(q["rule_times"])
                + "<h3>Wall time per job</h3>" + table(q["timings"]),
                queries["provenance"] + "\n\n" + queries["rule_times"] + "\n\n" + queries["timings"]),
    ]
    page = (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>{esc(title)}</title><style>{CSS}</style></head><body>{''.join(parts)}</body></html>"
    )
    for name, path in (figures or {}).items():
        with atomic_path(path) as tmp:
            tmp.write_text(charts[name], encoding="utf-8")
    with atomic_path(out_path) as tmp:
        tmp.write_text(page, encoding="utf-8")
