"""Your serving engine (issue 60): a serving engine's own KV caches (kvlab.methods.serving: llama.cpp's cache types,
vLLM's cache dtypes)
judged as every method is, against the engine's own default cache, and set beside kvlab's simulation of each (the
method's kvlab_twin) on the same prompts: whether kvlab's verdict transfers to the engine, and the share of answers on
which the two agree, with its anytime bounds."""

import pandas as pd

from kvlab.report.decision import Rule, cells
from kvlab.report.html import esc, table
from kvlab.stats.intervals import drop_bounds

TITLE = "Your serving engine"
QUERIES = ("serving",)
BY = ["model", "shape", "question_mode"]
DIFFER = {"safe": "within tolerance", "unsafe": "beyond tolerance", "inconclusive": "inconclusive"}


def transfers(engine: str, kvlab: str | None) -> str:
    """Whether kvlab's verdict on its simulation is the engine's: both decided alike, decided otherwise, or not known."""
    if kvlab is None:
        return "no kvlab twin"
    if engine in ("safe", "unsafe") and kvlab in ("safe", "unsafe"):
        return "transfers" if engine == kvlab else "does not transfer"
    return "inconclusive"


def verdicts(q: dict, rule: Rule) -> pd.DataFrame:
    """One row per cell of a serving engine's method (shape, question mode agnostic): its decision against the
    engine's own full cache, its kvlab twin's on kvlab's model, and whether the verdict transfers."""
    s, a = q["serving"], q["answers"]
    if s.empty:
        return pd.DataFrame()
    c = cells(a[a["model"].isin(set(s["engine_model"])) | a["model"].isin(set(s["model"]))], rule, by=BY)
    twins = s.drop_duplicates(["engine_model", "method"]).set_index(["engine_model", "method"])
    out = []
    for _, r in c[c["model"].isin(set(s["engine_model"]))].iterrows():
        model, twin = twins.loc[(r["model"], r["method"]), ["model", "kvlab_twin"]]
        t = c[(c["model"] == model) & (c["method"] == twin) & (c["shape"] == r["shape"]) & (c["question_mode"] == "agnostic")]
        kvlab = t["table_decision"].iloc[0] if len(t) else None
        out.append({
            "engine_model": r["model"], "shape": r["shape"], "method": r["method"], "scheme": twins.loc[(r["model"], r["method"]), "scheme"],
            "drop_points": r["drop_points"], "drop_low": r["drop_low"], "drop_high": r["drop_high"], "samples": r["samples"],
            "decision": r["table_decision"], "kvlab_twin": twin,
            "twin_drop_points": t["drop_points"].iloc[0] if len(t) else None, "twin_samples": t["samples"].iloc[0] if len(t) else None,
            "twin_decision": kvlab or "not run", "verdict": transfers(r["table_decision"], kvlab),
        })
    return pd.DataFrame(out)


def fidelity(q: dict, rule: Rule) -> pd.DataFrame:
    """Per (engine method, kvlab twin, shape) on scored tasks: the share of prompts on which the engine's answer is
    its twin's, with anytime bounds (the share that differ, bounded over the engine job's draw order at the decision's
    tolerance), and n."""
    s = q["serving"]
    s = s[s["same_answer"].notna()]
    out = []
    for (model, method, twin, shape), g in s.groupby(["engine_model", "method", "kvlab_twin", "shape"], sort=False):
        per = g.groupby("sample_id", sort=False)["same_answer"].mean()  # a sample's turns together, in draw order
        b = drop_bounds(pd.Series(1.0, index=per.index).to_numpy(), per.to_numpy(), rule.tolerance_points)
        out.append({"engine_model": model, "method": method, "kvlab_twin": twin, "shape": shape,
                    # a share lies in [0, 100]: the bounds cut there (the sequence's range for a drop reaches below 0)
                    "agree_points": 100 - b.mean, "agree_low": max(0.0, 100 - b.high), "agree_high": min(100.0, 100 - b.low),
                    "samples": b.n,
                    "differ": DIFFER[b.decide(rule.tolerance_points)]})
    return pd.DataFrame(out)


def body(q: dict[str, pd.DataFrame], rule: Rule) -> str:
    v = verdicts(q, rule)
    if v.empty:
        return ("<p>No method of this run is a serving engine's cache (kind llamacpp or vllm). Preset serving runs "
                "llama.cpp's q8_0 and q4_0 caches on the shipped workload and traffic beside kvlab's simulations (README "
                "\"Your serving engine\").</p>")
    engines = ", ".join(sorted(set(q["serving"]["engine"])))
    f = fidelity(q, rule)
    return (
        f"<p>The engine's own KV caches ({esc(engines)}; llama.cpp on the same GGUF weights kvlab dequantized, vLLM on "
        "the model folder kvlab evaluates), judged as every method is: each answer against the engine's default cache "
        "(llama.cpp's f16, the model's <code>@llamacpp</code> full; vLLM's auto, the model's <code>@vllm</code> full) on "
        "the prompts kvlab's jobs drew (the same token ids), in rounds under the same rule (drop in points with its "
        "anytime bounds, n samples, decision after e-BH). Beside each, its kvlab twin (the method's kvlab_twin) judged on "
        "kvlab's own model: <b>transfers</b> where both are decided alike, <b>does not transfer</b> where they are "
        "decided otherwise, <b>inconclusive</b> where either is open.</p>"
        + table(v)
        + "<p>Prompt by prompt: the share of prompts on which the engine's answer equals its twin's (agree_points, with "
        "anytime bounds over the engine job's draw order; a sample's turns averaged). The full caches' row is the floor: "
        "kvlab's engine and the serving engine's kernels (llama.cpp's quantized matmuls) already differ there, so a "
        "twin can agree with the engine no more often than the two full caches do. differ: the share that differ, "
        f"decided within or beyond the tolerance ({rule.tolerance_points:g} points).</p>"
        + (table(f) if not f.empty else "<p>No scored task: prose alone (the KL columns of the verdicts above).</p>")
    )
