"""Task kinds: one module per kind, one line here. A kind's module declares its parameters in `Params` (from which
kvlab.state.config makes the kind's branch of the config schema: kvlab.util.params, kvlab.tasks.params), has `generate(task
name, its config entry, the model's tokenizer, a context length)`, which returns seeded, deterministic Samples
(`generate` below calls it with the entry's `samples` for that length), and may have `problem(name, spec)`, the entry's first problem the schema cannot
express as (key under the task, what is wrong and what would be right) or None, and `derive(name, spec)`, which fills
values that follow from others; config validation calls both (`problem`, `derive` below)."""

from kvlab.tasks import arithmetic, common_words, continuation, dataset, frequent_words, multi_turn, needle, recency, ruler, variable_tracking

KINDS = {
    "niah": needle,
    "recency": recency,
    "variable_tracking": variable_tracking,
    "multi_turn": multi_turn,
    "common_words": common_words,
    "frequent_words": frequent_words,
    "arithmetic": arithmetic,
    "continuation": continuation,
    "ruler": ruler,
    "dataset": dataset,
}
GENERATORS = {kind: module.generate for kind, module in KINDS.items()}


def problem(name: str, spec: dict) -> tuple[str, str] | None:
    """The task entry's first problem its kind finds beyond the schema (key under the task, message), or None."""
    check = getattr(KINDS[spec["kind"]], "problem", None)
    return check(name, spec) if check else None


def derive(name: str, spec: dict) -> None:
    """Fill the values of a task entry that its kind derives from others (in place)."""
    fill = getattr(KINDS[spec["kind"]], "derive", None)
    if fill:
        fill(name, spec)

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


def samples_at(spec: dict, context_tokens: int) -> int:
    """A task's samples at one of its context lengths: `samples` is one number for every length, or one per entry of
    `context_tokens` (config validation checks the counts match)."""
    samples = spec["samples"]
    if isinstance(samples, int):
        return samples
    lengths = spec["context_tokens"]
    if context_tokens not in lengths or len(samples) != len(lengths):
        raise ValueError(f"samples {samples} has no entry for context length {context_tokens} (context_tokens {lengths}); "
                         "give one number per entry of context_tokens")
    return samples[lengths.index(context_tokens)]


def generate(name: str, spec: dict, tokenizer, context_tokens: int) -> list:
    """The samples of task `name` (its config entry `spec`) at `context_tokens`, from its kind's generator."""
    return GENERATORS[spec["kind"]](name, {**spec, "samples": samples_at(spec, context_tokens)}, tokenizer, context_tokens)
