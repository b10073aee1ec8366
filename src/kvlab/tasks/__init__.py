"""Task kinds: one module per kind, one line here. A kind's module declares, once:

- `NAME`, the kind's name (a config entry's `kind`, rows' `task_kind`);
- `Params`, its parameters (from which kvlab.state.config makes the kind's branch of the config schema:
  kvlab.util.params, kvlab.tasks.params);
- `generate(task name, its config entry, the model's tokenizer, a context length)`, which returns seeded,
  deterministic Samples of kind `NAME` (`generate` below calls it with the entry's `samples` for that length);
- `shape(sample)`, the sample's shape: the report's grouping, one row per shape in the article's decision table;

and, where it needs them: `problem(name, spec)`, the entry's first problem the schema cannot express as (key under
the task, what is wrong and what would be right) or None; `derive(name, spec)`, which fills values that follow from
others (config validation calls both: `problem`, `derive` below); `default_cap(spec)`, its answers' decoding cap where
the entry sets none (else the run's `max_new_tokens`); `reference_tokens(spec)`, the tokens of the reference text its
samples teacher-force where they ask no question (prose); `inputs(spec)`, the files its samples are read from (a
changed file reruns its jobs)."""

from kvlab.tasks import arithmetic, common_words, continuation, dataset, frequent_words, multi_turn, needle, recency, ruler, variable_tracking

KINDS = {kind.NAME: kind for kind in (needle, recency, variable_tracking, multi_turn, common_words, frequent_words, arithmetic, continuation,
                                      ruler, dataset)}


def problem(name: str, spec: dict) -> tuple[str, str] | None:
    """The task entry's first problem its kind finds beyond the schema (key under the task, message), or None."""
    check = getattr(KINDS[spec["kind"]], "problem", None)
    return check(name, spec) if check else None


def derive(name: str, spec: dict) -> None:
    """Fill the values of a task entry that its kind derives from others (in place)."""
    fill = getattr(KINDS[spec["kind"]], "derive", None)
    if fill:
        fill(name, spec)


def shape(sample) -> str:
    """A sample's shape, as its kind gives it (kvlab.tasks.base.Sample.shape)."""
    return KINDS[sample.kind].shape(sample)


def max_new_tokens(spec: dict, run_default: int) -> int:
    """A task's greedy decoding cap: its own `max_new_tokens`, else its kind's `default_cap`, else the run's."""
    if "max_new_tokens" in spec:
        return spec["max_new_tokens"]
    kind_cap = getattr(KINDS[spec["kind"]], "default_cap", None)
    return kind_cap(spec) if kind_cap else run_default


def reference_tokens(spec: dict) -> int | None:
    """The reference tokens a task's samples teacher-force in place of an answer (its kind's `reference_tokens`: prose
    continuation's), or None where its samples are asked a question and answer it."""
    tokens = getattr(KINDS[spec["kind"]], "reference_tokens", None)
    return tokens(spec) if tokens else None


def inputs(spec: dict) -> list[str]:
    """The files a task's samples are read from (its kind's `inputs`: a dataset's file), [] where it generates them."""
    files = getattr(KINDS[spec["kind"]], "inputs", None)
    return files(spec) if files else []


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
    return KINDS[spec["kind"]].generate(name, {**spec, "samples": samples_at(spec, context_tokens)}, tokenizer, context_tokens)
