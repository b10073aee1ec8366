"""Task generators by kind: one module per kind, one line here. A generator takes (task name, its config
entry, the model's tokenizer, a context length) and returns seeded, deterministic Samples."""

from kvlab.tasks import arithmetic, common_words, continuation, frequent_words, multi_turn, needle, recency, ruler, variable_tracking

GENERATORS = {
    "niah": needle.generate,
    "recency": recency.generate,
    "variable_tracking": variable_tracking.generate,
    "multi_turn": multi_turn.generate,
    "common_words": common_words.generate,
    "frequent_words": frequent_words.generate,
    "arithmetic": arithmetic.generate,
    "continuation": continuation.generate,
    "ruler": ruler.generate,
}

# A kind's own decoding cap where its task sets none (else the run's `max_new_tokens`): RULER lets a model write
# its tokens_to_generate (128 for niah, 120 for cwe, 50 for fwe, 32 for qa, 30 for vt), and a shorter cap cuts
# answers its metric needs whole (several values, ten words).
DEFAULT_CAPS = {
    "ruler": lambda spec: ruler.task_config(spec["ruler_task"])["tokens_to_generate"],
}


def max_new_tokens(spec: dict, run_default: int) -> int:
    """A task's greedy decoding cap: its own `max_new_tokens`, else its kind's default, else the run's."""
    if "max_new_tokens" in spec:
        return spec["max_new_tokens"]
    kind_cap = DEFAULT_CAPS.get(spec["kind"])
    return kind_cap(spec) if kind_cap else run_default
