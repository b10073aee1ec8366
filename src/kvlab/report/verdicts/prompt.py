"""C17 from prompt compression's answers (the answers query), decided from the paired drop's bounds."""

from __future__ import annotations

from kvlab.stats.intervals import drop_bounds, per_sample, wilson


def c17(q: dict, t) -> list[tuple[str, str, str]]:
    """Prompt compression at `t.budget` loses the needle's detail: its accuracy drop against the full cache on the
    single needle, question modes pooled, beyond `t.tolerance_points` (holds: lower bound above; does not hold:
    upper bound within)."""
    a = q["answers"]
    rows = a[(a["method_kind"] == "prompt_compression") & (a["shape"] == "single needle") & a["score"].notna()
             & ((a["budget"] - t.budget).abs() < 1e-9)]
    if rows.empty:
        return [("", "not measured", f"no prompt_compression method scored on the single needle at budget {t.budget:g}")]
    out = []
    for method, g in rows.groupby("method", sort=True):
        s = per_sample(g, ["score", "full_score"])
        b = drop_bounds(s["full_score"].to_numpy(), s["score"].to_numpy(), t.tolerance_points)
        verdict = "holds" if b.low > t.tolerance_points else "does not hold" if b.high <= t.tolerance_points else "inconclusive"
        low, high = wilson(g["score"].sum(), len(g))
        out.append((f" ({method})", verdict,
                    f"{method}: {g['score'].mean():.0%} [{low:.0%}, {high:.0%}] vs full {g['full_score'].mean():.0%} over {len(g)} "
                    f"answers (question modes pooled), {g['kv_fraction_bf16'].mean():.0%} of the bytes; drop "
                    f"{b.mean:+.1f} points [{b.low:+.1f}, {b.high:+.1f}] over {b.n} samples."))
    return out
