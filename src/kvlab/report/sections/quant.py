"""Quantized caches: C3, C4, C5 and C10, KL vs bits on prose, the 2-bit ablation, transformers' baseline and
accuracy on the scored tasks."""

import altair as alt
import pandas as pd

from kvlab.report.claims import verdicts
from kvlab.report.decision import Rule
from kvlab.report.html import svg, table, verdict_list
from kvlab.stats.intervals import drop_bounds, per_sample
from kvlab.report.tables import pooled, where, with_kl_bounds, with_wilson

TITLE = "Quantized KV caches"
QUERIES = ("quant_kl", "quant_accuracy")
CLAIMS = [3, 4, 5, 10]


def _series(frame: pd.DataFrame) -> pd.Series:
    """A label per storage layout: the scheme, with KIVI's axes when they are not KIVI's own, and its streaming
    policy when it is not KIVI's."""
    def label(r) -> str:
        text = str(r.scheme)
        if r.scheme == "kivi" and (r.key_axis, r.value_axis) != ("channel", "token"):
            text += f" (keys per {r.key_axis}, values per {r.value_axis})"
        if r.scheme == "kivi" and r.policy != "kivi":
            text += f", policy {r.policy}"
        return text
    return frame.apply(label, axis=1)


def kl_bits_chart(kl: pd.DataFrame) -> alt.TopLevelMixin:
    """Per-token KL vs bits per element, one line per scheme, one panel per prefix length (no eviction), each
    point with the bootstrap bounds of its mean over samples as a bar (where enough samples bound it)."""
    data = kl[kl["budget"] == 1]
    data = data.assign(series=_series(data), kl=data["kl_mean_nats"].clip(lower=1e-6),
                       low=data["kl_low"].clip(lower=1e-6), high=data["kl_high"].clip(lower=1e-6))
    x = alt.X("bits:Q", title="bits per element", scale=alt.Scale(type="log", base=2, domain=[2, 8]))
    y = alt.Y("kl:Q", title="mean per-token KL vs full (nats)", scale=alt.Scale(type="log"))
    line = alt.Chart().mark_line(point=True).encode(
        x=x, y=y, color=alt.Color("series:N", title="scheme"),
        tooltip=["method:N", "bits:Q", "kl_mean_nats:Q", "kl_low:Q", "kl_high:Q", "samples:Q", "delta_ppl:Q"],  # typed: an
        # empty run (no prose task) leaves nothing to infer them from
    )
    bars = alt.Chart().mark_rule(opacity=0.6).encode(x=x, y=alt.Y("low:Q", scale=alt.Scale(type="log")), y2="high:Q",
                                                     color="series:N")
    return alt.layer(line, bars, data=data).properties(width=320, height=220).facet(
        column=alt.Column("context_tokens:O", title="prefix tokens"))


def with_bounds(q: dict[str, pd.DataFrame], rule: Rule) -> pd.DataFrame:
    """quant_kl with the bounds of each mean KL (bootstrap over samples, kvlab.stats.intervals)."""
    return with_kl_bounds(q["quant_kl"], q["answers"], ["model", "method", "budget", "context_tokens"], rule.kl_min_samples)


def figure(q: dict[str, pd.DataFrame], rule: Rule) -> str:
    return svg(kl_bits_chart(with_bounds(q, rule)))


def ablation_table(kl: pd.DataFrame, by_task: pd.DataFrame, answers: pd.DataFrame, tolerance: float) -> pd.DataFrame:
    """The article's KIVI table shape: 2-bit KIVI by key axis × value axis, KL per prefix and accuracy on the
    tasks all four ran on, with the accuracy drop against the full cache on the same answers and its paired
    bounds over samples (kvlab.stats.intervals.drop_bounds at the decision's `tolerance`, as the decision table's)."""
    def two_bit(frame: pd.DataFrame) -> pd.DataFrame:
        return frame[(frame["scheme"] == "kivi") & (frame["bits"] == 2) & (frame["policy"] == "kivi") & (frame["budget"] == 1)]

    two = two_bit(kl)
    if two.empty:
        return pd.DataFrame()
    keys = ["model", "key_axis", "value_axis"]
    out = two.pivot_table(index=keys, columns="context_tokens", values="kl_mean_nats")
    out.columns = [f"KL @ {c} tokens" for c in out.columns]
    a = pooled(two_bit(by_task), common_tasks=True)
    scored = two_bit(answers)
    scored = scored[scored["score"].notna() & scored["task"].isin({t for ts in a["tasks"] for t in ts.split(", ")})]
    drops = pd.DataFrame([(*key, b.mean, b.low, b.high, b.n) for key, g in scored.groupby(keys)
                          for b in [drop_bounds(*per_sample(g, ["full_score", "score"]).to_numpy().T, tolerance)]],
                         columns=[*keys, "drop_points", "drop_low", "drop_high", "samples"])
    a = with_wilson(a).merge(drops, on=keys, how="left").set_index(keys)[
        ["accuracy", "accuracy_low", "accuracy_high", "full_accuracy", "full_low", "full_high", "drop_points", "drop_low",
         "drop_high", "samples", "rows", "tasks"]]
    return out.join(a).reset_index().rename(columns={"key_axis": "keys per", "value_axis": "values per"})


def policy_table(kl: pd.DataFrame) -> pd.DataFrame:
    """KIVI's own streaming policy beside kvlab's earlier one (`together`), paired by model, bits, axes and prefix
    (rows do not carry G and R: the configs give each pair the same): mean KL per prefix with its bounds and n,
    and what each stores."""
    kivi = kl[(kl["scheme"] == "kivi") & (kl["budget"] == 1)]
    on = ["model", "bits", "key_axis", "value_axis", "context_tokens"]
    pairs = where(kivi, policy="kivi").merge(where(kivi, policy="together"), on=on, suffixes=("", "_together"))
    columns = ["method", "kl_mean_nats", "kl_low", "kl_high", "samples", "compression_vs_bf16"]
    return pairs[on + columns + [f"{c}_together" for c in columns]]


def body(q: dict[str, pd.DataFrame], rule: Rule) -> str:
    kl, by_task = with_bounds(q, rule), q["quant_accuracy"]
    if kl.empty and by_task.empty:
        return "<p>No quantized cache was configured in this run.</p>"
    hf = where(kl, scheme="hf_quanto", budget=1.0)
    ours = where(kl, scheme="kivi", key_axis="channel", value_axis="token", policy="kivi", budget=1.0)
    versus = ours.merge(hf, on=["model", "bits", "context_tokens"], suffixes=("", "_hf"))
    baseline = ""
    if not versus.empty:
        versus = versus.assign(times_lower=versus["kl_mean_nats_hf"] / versus["kl_mean_nats"])[
            ["model", "bits", "context_tokens", "method", "kl_mean_nats", "kl_low", "kl_high", "samples", "method_hf",
             "kl_mean_nats_hf", "kl_low_hf", "kl_high_hf", "samples_hf", "times_lower"]]
        baseline = "<h3>Against transformers' QuantizedCache (same bits, G and R)</h3>" + table(versus)
    ablation = ablation_table(kl, by_task, q["answers"], rule.tolerance_points)
    policies = policy_table(kl)
    return (
        "<p>Packed codes inside generation: prefill attention is exact, then each full-attention layer keeps "
        "codes + metadata + a full-precision residual. KIVI streams as its own code does: keys are quantized R "
        "at a time once R are held in full precision (0 to R − 1 stay), values one at a time beyond the newest R "
        "(R stay); `policy: together`, kvlab's earlier policy, moves keys and values together in whole groups "
        "of G beyond the newest R (R to R + G − 1 of each stay, so more full precision). FP8 and INT8 keep no residual unless one is configured: every token, "
        "decoded ones included, is stored quantized, as a deployed FP8 cache does. The continuation of real prose is fed one token at a "
        "time, so every token attends to the cache as it is stored. Sliding-window layers (Gemma 3) are never "
        "quantized.</p>"
        + verdict_list(verdicts(CLAIMS, q, rule))
        + "<p class='note'>kl_low, kl_high: one-sided 95% bounds of the mean per-sample KL (bootstrap over the "
        f"samples; blank under {rule.kl_min_samples} samples). saturated_keys, saturated_values: the mean share of "
        "the context's coded key and value entries that FP8 clamped at ±448 × scale (their error is the clamp, not "
        "rounding; blank for formats whose range covers every input); a method entry's <code>max_saturated</code> "
        "refuses a cache past a share.</p>" + (svg(kl_bits_chart(kl)) if not kl.empty else "") + table(kl)
        + ("<h3>2-bit ablation (KIVI's table shape)</h3><p class='note'>Accuracy on the scored tasks all four layouts "
           "ran on; drop_points: the mean accuracy drop against the full cache on the same answers, with one-sided 95% "
           "bounds over paired samples (drop_low, drop_high; the betting confidence sequence; samples: n), as in the "
           "decision table.</p>"
           + table(ablation) if not ablation.empty else "")
        + ("<h3>KIVI's streaming policy against kvlab's earlier one</h3><p class='note'>Paired by bits, axes and "
           "prefix (the configured pairs share G and R); only which recent tokens stay in full precision differs "
           "(columns _together: policy together). KL bounds and samples as above.</p>" + table(policies)
           if not policies.empty else "")
        + baseline + "<h3>Accuracy on the scored tasks</h3><p class='note'>All answers of the tasks each method ran "
        "on, pooled (a method limited by its `tasks` list is scored on those only), with the Wilson 95% interval "
        "over the answers.</p>" + table(with_wilson(pooled(by_task)))
    )
