"""C3, C4, C5 and C10 from the quantized caches' prose KL (quant_kl) and task accuracy (quant_accuracy),
without eviction (budget 1)."""

from __future__ import annotations

from kvlab.report.tables import pooled, where


def _kl(q: dict):
    return q["quant_kl"][q["quant_kl"]["budget"] == 1]


def c3(q: dict, t) -> list[tuple[str, str, str]]:
    """FP8's mean per-token KL on prose at most `t.kl` at every context length."""
    fp8 = where(_kl(q), scheme="fp8")
    if fp8.empty:
        return [("", "not measured", "no fp8 method in this run")]
    each = "; ".join(f"{r.method} {r.kl_mean_nats:.2g} nat at {r.context_tokens} tokens" for r in fp8.itertuples())
    return [("", "holds" if fp8["kl_mean_nats"].max() <= t.kl else "does not hold", f"{each}.")]


def c4(q: dict, t) -> list[tuple[str, str, str]]:
    """2-bit KIVI: keys per channel stay at or below `t.holds_kl`, keys per token reach at least `t.collapse_kl`."""
    kl = _kl(q)
    chan = where(kl, scheme="kivi", bits=2, key_axis="channel", value_axis="token")
    tok = where(kl, scheme="kivi", bits=2, key_axis="token", value_axis="token")
    if chan.empty or tok.empty:
        return [("", "not measured", "needs 2-bit kivi with key_axis channel and token")]
    c, k = chan["kl_mean_nats"].max(), tok["kl_mean_nats"].min()
    return [("", "holds" if c <= t.holds_kl and k >= t.collapse_kl else "does not hold",
             f"keys per channel: KL up to {c:.3g} nat; keys per token: at least {k:.3g} nat ({k / c:.0f}×).")]


def c5(q: dict, t) -> list[tuple[str, str, str]]:
    """4-bit KIVI's pooled accuracy within `t.points` of the full cache."""
    acc = pooled(q["quant_accuracy"])
    int4 = where(acc[acc["budget"] == 1], scheme="kivi", bits=4, key_axis="channel", value_axis="token")
    if int4.empty:
        return [("", "not measured", "no 4-bit kivi method scored on tasks")]
    r = int4.iloc[0]
    return [("", "holds" if abs(r.delta_points) <= t.points else "does not hold",
             f"{r.method}: {r.accuracy:.1%} vs full {r.full_accuracy:.1%} over {r.rows} scored answers ({r.tasks}; "
             f"question modes and turns pooled), {r.delta_points:+.1f} points.")]


def c10(q: dict, t) -> list[tuple[str, str, str]]:
    """4-bit KIVI's codes + metadata give `t.ratio` (± `t.slack`) over bf16."""
    int4 = where(_kl(q), scheme="kivi", bits=4, key_axis="channel", value_axis="token")
    if int4.empty:
        return [("", "not measured", "no 4-bit kivi method on prose")]
    r = int4.iloc[0]
    return [("", "holds" if abs(r.codes_vs_bf16 - t.ratio) <= t.slack else "does not hold",
             f"{r.method}: stored codes + metadata give {r.codes_vs_bf16:.3f}× over bf16 for the quantized tokens "
             f"(measured from the tensors); the whole cache at {r.context_tokens} tokens, with its full-precision "
             f"residual, {r.compression_vs_bf16:.2f}×.")]
