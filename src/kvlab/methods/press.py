"""kvpress presses in a method entry (`press`, `kwargs`, `wrapper`, `wrapper_kwargs`, `layer_budgets`): their
checks against kvpress's own sources (`kvlab.methods.press_source`, no kvpress import) and the press objects."""

from __future__ import annotations

from typing import Any

from kvlab.methods import press_source

PRESS_NAME = "^[A-Z][A-Za-z0-9]*Press$"  # the pattern of a press's class name in the schema

# (key under the method entry, what is wrong and what would be right): config validation adds the file and path
Problem = tuple[str, str] | None


def press_problem(params: dict) -> Problem:
    """The first problem of an entry's press settings, or None: the press and wrapper exist in kvpress, their
    keyword arguments are fields of theirs within their ranges, and what kvlab sets is not set here."""
    press, presses = params["press"], press_source.kvpress_press_names()
    if not presses:
        return "press", "kvpress is not installed; run `make setup`"
    if press not in presses:
        close = press_source.suggest_press(press, presses)
        return "press", f"kvpress has no press '{press}'" + (f"; {close}" if close else f"; kvpress has: {', '.join(sorted(presses))}")
    if params.get("wrapper_kwargs") and "wrapper" not in params:
        return "wrapper_kwargs", "needs a `wrapper` press to configure"
    wrapper = params.get("wrapper")
    if wrapper is not None and wrapper not in (wrappers := press_source.kvpress_wrapper_names()):
        what = "is a press that wraps no other" if wrapper in presses else "is not a kvpress press"
        return "wrapper", f"'{wrapper}' {what}; wrappers: {', '.join(sorted(wrappers))}"
    if "press" in params.get("wrapper_kwargs", {}):
        return "wrapper_kwargs.press", "the wrapped press is `press`; remove it here"
    for key, value in params.get("kwargs", {}).items():
        if value == "calibrated" and key != "n_sink":
            return f"kwargs.{key}", "'calibrated' is only available for n_sink (StreamingLLM's sink count from calibration)"
    for field, cls, kwargs in (("kwargs", press, params.get("kwargs", {})), ("wrapper_kwargs", wrapper, params.get("wrapper_kwargs", {}))):
        problem = cls and press_source.kwargs_problem(cls, {k: v for k, v in kwargs.items() if k != "compression_ratio"}, ("calibrated",))
        if problem:
            return f"{field}.{problem[0]}", problem[1]
    if wrapper and (problem := press_source.wrapper_problem(wrapper, press)):
        return "wrapper", problem
    if params.get("layer_budgets") and press == "PyramidKVPress":
        return "layer_budgets", "PyramidKVPress sets its own per-layer budgets; use it with SnapKVPress or another press"
    if "compression_ratio" in params.get("kwargs", {}):
        return "kwargs.compression_ratio", "set by `budgets`, remove it here"
    return None


def make_press(params: dict, budget: float) -> Any:
    """A fresh kvpress press keeping `budget` of the context (None without `press`); with `wrapper`, the press
    wrapped in that kvpress wrapper (KeyRerotationPress, MergingPress, …), built with `wrapper_kwargs`."""
    if "press" not in params:
        return None
    import kvpress

    press = getattr(kvpress, params["press"])(compression_ratio=1.0 - budget, **params.get("kwargs", {}))
    if "wrapper" in params:
        press = getattr(kvpress, params["wrapper"])(press=press, **params.get("wrapper_kwargs", {}))
    return press
