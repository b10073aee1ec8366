"""C1 and C2 from the calibration pass: one verdict per calibrated model."""

from __future__ import annotations


def c1(q: dict, t) -> list[tuple[str, str, str]]:
    """Keys' median outlier score at least `t.factor` times values'."""
    return [(
        f" on {r.model}", "holds" if r.key_pre_rope >= t.factor * r.value else "does not hold",
        f"median outlier score per head (largest channel / median channel) {r.key_pre_rope:.2f}× for keys before "
        f"RoPE, {r.key_post_rope:.2f}× after, {r.value:.2f}× for values (ratio {r.key_pre_rope / r.value:.2f}; "
        f"largest head: keys {r.key_pre_rope_max:.1f}×, values {r.value_max:.1f}×).",
    ) for r in q["calib_c1"].itertuples()]


def c2(q: dict, t) -> list[tuple[str, str, str]]:
    """Token 0's residual magnitude at least `t.massive` times every other position's, and at least `t.mass`
    of attention on token 0 in some layer."""
    return [(
        f" on {r.model}", "holds" if r.massive_ratio >= t.massive and r.token0_mass_max >= t.mass else "does not hold",
        f"token 0's residual magnitude reaches {r.token0_max_abs:,.4g}, "
        f"{r.massive_ratio:.0f}× every other position (layer {r.massive_layer}); token 0 takes {r.token0_mass_max:.0%} "
        f"of attention in layer {r.token0_mass_layer} and {r.token0_mass_mean:.0%} on average over layers.",
    ) for r in q["calib_c2"].itertuples()]
