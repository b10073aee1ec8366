"""Your own workload: a task whose samples are the rows of a file (`kind: dataset`).

A row gives a `context` (the document: always compressed), a `question` (compressed only question-aware), its
`answers` (one string or a list; the scorer takes the best match), an optional `id` and optional `followups`
(later questions on the same cache, each {question, answers}, asked as multi_turn asks them). `columns` maps these
names to the file's own.

Prompts only: a row may leave out `answers` (traffic logs rarely have references). Such a task is scored by
`agreement` (its default metric then): each method's greedy answer against the full cache's answer to the same
prompt, 1 when they match after SQuAD's normalisation, else 0 (`agreement_f1`: their token F1), so a cell's drop is
the share of answers the compression changed (kvlab.tasks.scoring; the engine passes the full cache's answer as the
gold: kvlab.engine.sample). Rows with answers may use it too (`metric: agreement`). Followups need the row's answers
(the first answer is fed before the next question).

Chat logs: a row may instead give `messages`, a list of {role, content} (system, user, assistant: the chat format
of transformers' chat templates and of the usual serving APIs), ending on a user turn, and optionally `answers` for
that last turn. The model's own chat template renders them: the turns before the asked user turn are the context
(compressed; the chat template's text before the first turn is the uncompressed prefix), that turn's content the
question, the template's end of turn and assistant header the suffix. `chat_turns: last` (default) asks the last user
turn; `chat_turns: each` asks every user turn in order on one cache, as followups are: the first user turn on the
compressed turns before it, each later one after the logged turns between (assistant replies, as recorded). A turn
with nothing before it to compress (a conversation that opens on the asked user turn) is itself the context, with no
separate question (compressed alike in both question modes, as a question asked before its document). Chat rows are
kept whole (`context_tokens: [0]`); the `template` does not apply to them. Files: JSON lines (.jsonl, or .json holding lines or one array), .csv (a list-valued
cell as a JSON array), .parquet, or a folder written by `datasets`' save_to_disk (read offline).

Prompts: the user turn is `template` with {context} and {question} filled (default: the context, a blank line, the
question), in the model's chat template. Only the document is compressed, as kvpress compresses only its context: the
template's text before {context} (with the chat template's head before it) is the prompt's uncompressed `prefix`, no
method evicts it and budgets count the tokens after it; its text after {context} goes with the question (compressed
only question-aware). `context_tokens` 0 keeps each prompt at its natural length (`prompt_tokens`
on each row); N > 0 cuts a longer prompt to N tokens by dropping the middle of its context, keeping its head and
tail as LongBench truncates its prompts, but never the question or template (rows carry `cut_tokens`).

Samples: a seeded permutation of the rows (by task name and seed), taken in order, so more samples (the
evaluation's rounds) only add rows after those drawn. Every row is checked before any is used: a file that does not
parse, a missing column, an empty context, question or answer, a repeated id, a bad conversation (no user turn, an
unknown role, content that is not text, a last turn that is not the user's) each stop with one line naming the
file, the row (1-based) and the field (kvlab.tasks.rows).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import ClassVar, Literal

from kvlab.util.params import param, shared
from kvlab.tasks.base import Prompt, Sample, Turn, chat_pieces, chat_prompt, encode
from kvlab.tasks.params import Answered
from kvlab.tasks.rows import FIELDS, DatasetError, Record, load
from kvlab.tasks.scoring import AGREEMENT

PROMPTS_ONLY_RECIPES = {"qa_mix": False, "chat_mix": True}  # whether a recipe's rows leave out answers
DEFAULT_TEMPLATE = "{context}\n\n{question}"


NAME = "dataset"


def shape(sample: Sample) -> str:
    return sample.meta["shape"]  # its entry's (`entry_shape`)


def inputs(spec: dict) -> list[str]:
    return [spec["path"]]  # the user's file, or the one its recipe writes


@dataclass(kw_only=True)
class Params:  # Answered's keys, after its own (defaults are filled in this order)
    SCHEMA: ClassVar[dict] = {"oneOf": [{"required": ["path"]}, {"required": ["recipe"]}]}

    path: str | None = param(None, "your rows: .jsonl, .json, .csv, .parquet, or a datasets save_to_disk folder; relative to the "
                             "working directory or absolute (kvlab.tasks.dataset)", minLength=1)
    recipe: str | None = param(None, "instead of path: a file the pipeline writes (results/workloads/<task>.jsonl) from the SQuAD "
                               "and HotpotQA data RULER's package ships; qa_mix: multi-document QA rows with answers; chat_mix: "
                               "prompts-only conversations (messages, no answers: scored by agreement)", enum=list(PROMPTS_ONLY_RECIPES))
    recipe_rows: int = param(120, "rows the recipe writes", minimum=1)
    recipe_words: list[int] = param([700, 1400], "the whole-word length of each row's documents the recipe writes: [low, high] "
                                    "(about 1.3 Qwen tokens per word; the smoke preset's byte tokenizer takes ~6 a word)",
                                    minItems=2, maxItems=2, items={"type": "integer", "minimum": 1})
    columns: dict[str, str] = param({}, "the file's column for each field, where it differs from the field's name",
                                    additionalProperties=False, properties={f: {"type": "string"} for f in FIELDS})
    metric: str | None = param(
        None, "qa_f1 (SQuAD/LongBench token F1), exact_match, rouge_l (ROUGE-L F), or a RULER substring match: the best over a "
        "row's answers; agreement (no answers needed): 1 when the answer is the full cache's answer to the same prompt after "
        "normalisation, agreement_f1 its token F1 against it. Default: agreement when rows leave out answers, else qa_f1",
        enum=["qa_f1", "exact_match", "rouge_l", "string_match_all", "string_match_part", "last_number", *AGREEMENT])
    chat_turns: Literal["last", "each"] = param("last", "rows in chat format (messages): ask the last user turn (the turns before "
                                                "it are the context), or each user turn in order on one cache (as followups)")
    template: str = param(DEFAULT_TEMPLATE, "the user turn: {context} then {question}, each once")
    shape: str | None = param(None, "the report's row for this workload (default: workload <task name>)")
    context_tokens: list[int] = param([0], "0: each prompt at its natural length; N: prompts longer than N tokens lose the middle "
                                      "of their context (one job per entry)", minItems=1, uniqueItems=True,
                                      items={"minimum": 0, "maximum": 131072})
    samples: int = param(20, "rows drawn first (a seeded permutation of the file's rows)", minimum=1)
    max_samples: int | None = shared(Answered, "max_samples")
    seed: int = shared(Answered, "seed")
    max_new_tokens: int | None = shared(Answered, "max_new_tokens")


def generate(name: str, spec: dict, tokenizer, context_tokens: int) -> list[Sample]:
    records = load(spec["path"], spec.get("columns", {}))
    order = list(range(len(records)))
    random.Random(f"{name}:{spec['seed']}").shuffle(order)
    template = spec.get("template", DEFAULT_TEMPLATE)
    return [make_sample(name, spec, tokenizer, context_tokens, template, records[i]) for i in order[: spec["samples"]]]


def derive(name: str, spec: dict) -> None:
    """A task whose file a recipe writes reads it where the pipeline writes it (rule workload). Its metric, where not
    given: `agreement` when rows leave out answers (a prompts-only recipe, or a file with a row without answers),
    else `qa_f1`."""
    if "recipe" in spec:
        spec["path"] = f"results/workloads/{name}.jsonl"
    if "metric" not in spec:
        if "recipe" in spec:
            prompts_only = PROMPTS_ONLY_RECIPES[spec["recipe"]]
        else:
            try:
                prompts_only = any(not r.answers for r in load(spec["path"], spec.get("columns", {})))
            except DatasetError:  # `problem` says what is wrong with the file
                prompts_only = False
        spec["metric"] = "agreement" if prompts_only else "qa_f1"


def problem(name: str, spec: dict):
    """The template, and the file: every row readable and complete, at least `samples` of them (a file a recipe writes
    is checked when it is read)."""
    if why := check_template(spec["template"]):
        return "template", why
    if "recipe" in spec:
        rows, source = spec["recipe_rows"], f"recipe_rows {spec['recipe_rows']}"
        low, high = spec["recipe_words"]
        if low >= high:
            return "recipe_words", f"[{low}, {high}] is no range: give [low, high] with low < high, e.g. [700, 1400]"
        if PROMPTS_ONLY_RECIPES[spec["recipe"]] and spec["metric"] not in AGREEMENT:
            return "metric", (f"recipe {spec['recipe']} writes rows without answers, which metric {spec['metric']} scores "
                              "against; use metric: agreement or agreement_f1")
        if spec["recipe"] == "chat_mix" and any(spec["context_tokens"]):
            return "context_tokens", "recipe chat_mix writes conversations, kept whole, never cut; use context_tokens: [0]"
    else:
        try:
            records = load(spec["path"], spec["columns"])
        except DatasetError as error:
            return "path", str(error)
        rows, source = len(records), f"the rows of {spec['path']}"
        if why := rows_problem(spec, records):
            return why
    if spec["samples"] > rows:
        return "samples", f"{spec['samples']} exceeds {source} ({rows}); draw at most {rows}"
    return None


def rows_problem(spec: dict, records) -> tuple[str, str] | None:
    """What the task's settings cannot do with its rows (key, one line naming file, row and field), or None: a
    reference metric on a row without answers (or on a chat row that asks several turns), a chat row cut to a length."""
    path, each = spec["path"], spec.get("chat_turns") == "each"
    for r in records:
        roles = [role for role, _ in r.messages if role != "system"]
        if each and any(a == b == "user" for a, b in zip(roles, roles[1:])):
            return "chat_turns", (f"{path} row {r.row}: field messages: two user turns with no assistant reply between "
                                  "them; chat_turns: each feeds the logged reply before the next question (or use "
                                  "chat_turns: last)")
        if r.messages and any(spec["context_tokens"]):
            return "context_tokens", (f"{path} row {r.row}: field messages: a conversation is kept whole, never cut; use "
                                      "context_tokens: [0]")
        if spec["metric"] not in AGREEMENT:
            if not r.answers:
                return "metric", (f"{path} row {r.row}: no answers (field answers), which metric {spec['metric']} scores "
                                  "against; add them, or use metric: agreement (the full cache's answer as the reference)")
            if r.messages and r.asked(each) > 1:
                return "metric", (f"{path} row {r.row}: field messages: chat_turns: each asks {r.asked(each)} user turns and "
                                  f"answers hold the last one's only; use metric: agreement, or chat_turns: last")
    return None


def entry_shape(name: str, spec: dict) -> str:
    """The report's row for this workload: its `shape`, else 'workload <name>'."""
    return spec.get("shape") or f"workload {name}"


def check_template(template: str) -> str | None:
    """What is wrong with an instruction template (None if nothing): one {context}, then one {question}."""
    if template.count("{context}") != 1 or template.count("{question}") != 1:
        return "needs {context} and {question} once each"
    if template.index("{context}") > template.index("{question}"):
        return "puts {question} before {context}; the question must follow the document (only the document is cut and always compressed)"
    return None


def make_sample(name: str, spec: dict, tokenizer, context_tokens: int, template: str, record: Record) -> Sample:
    if record.messages:
        prompt, cut = chat_messages(tokenizer, record, spec.get("chat_turns") == "each", spec["path"]), 0
        if context_tokens and prompt.tokens > context_tokens:
            raise DatasetError(f"task '{name}': {spec['path']} row {record.row}: field messages: a conversation is kept "
                               "whole, never cut; use context_tokens: [0]")
        return _sample(name, spec, context_tokens, record, prompt, cut)
    head, tail = template.split("{question}")
    before_context, after_context = head.split("{context}")
    turns, previous = [], record.answers
    for question, answers in record.followups:
        turns.append((previous[0], question, list(answers)))
        previous = answers

    def build(context: str):
        prompt = chat_prompt(tokenizer, before_context + context, after_context + record.question + tail, turns)
        return replace(prompt, prefix=kept_prefix(tokenizer, prompt, before_context, after_context + record.question + tail))

    prompt, cut = build(record.context), 0
    if context_tokens and prompt.tokens > context_tokens:
        natural, ids = prompt.tokens, encode(tokenizer, record.context)
        keep = len(ids) - (prompt.tokens - context_tokens)
        for _ in range(8):  # re-encoding the joined text can move a token boundary: trim until it fits
            if keep < 2:
                raise DatasetError(f"task '{name}': {spec['path']} row {record.row}: the template and question alone take "
                                   f"{natural - len(ids)} of context_tokens {context_tokens}; use a longer context_tokens")
            text = tokenizer.decode(ids[: keep - keep // 2]) + tokenizer.decode(ids[len(ids) - keep // 2 :])
            prompt = build(text)
            if prompt.tokens <= context_tokens:
                break
            keep -= prompt.tokens - context_tokens
        cut = natural - prompt.tokens
    return _sample(name, spec, context_tokens, record, prompt, cut)


def _sample(name: str, spec: dict, context_tokens: int, record: Record, prompt: Prompt, cut: int) -> Sample:
    return Sample(
        task=name,
        kind=NAME,
        sample_id=f"{name}-{context_tokens}-{record.id}",
        context_tokens=context_tokens,
        depth=None,
        seed=spec["seed"],
        prompt=prompt,
        gold=list(record.answers),
        metric=spec["metric"],
        meta={"shape": entry_shape(name, spec), "row": record.row, "path": str(spec["path"]), "cut_tokens": cut,
              "field": "messages" if record.messages else "context"},
    )


MARKER = "\x00KVLAB-SPLIT\x00"


def chat_messages(tokenizer, record: Record, each: bool, path) -> Prompt:
    """A chat row's Prompt (see the module's doc): the turns before the asked user turn are the context, its
    content the question; with `each`, the first user turn is asked and every later one is a followup (the logged
    turns between it and the one before, then it), with the row's answers on the last. A conversation that opens on
    the asked turn has it in its context and no question."""
    turns = [{"role": role, "content": content} for role, content in record.messages]
    users = [i for i, (role, _) in enumerate(record.messages) if role == "user"]
    first = users[0] if each else users[-1]

    def render(messages: list[dict]) -> str:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    head, question, suffix = render([*turns[:first], {**turns[first], "content": MARKER + turns[first]["content"] + MARKER}]).split(MARKER)
    if first == 0:  # nothing before it: the turn is the context, asked before its document (no separate question)
        head, question = head + question, ""
    context = encode(tokenizer, head)
    opening = render([{**turns[0], "content": MARKER + turns[0]["content"]}, *turns[1 : first + 1]]).split(MARKER)[0]
    ids = encode(tokenizer, opening)  # the chat template's text before the first turn: the uncompressed prefix
    prefix = next((i for i, (a, b) in enumerate(zip(context, ids)) if a != b), min(len(context), len(ids)))
    fed, later = head + question + suffix, []
    asked = users[users.index(first) + 1 :] if each else []
    for n, u in enumerate(asked, start=1):
        rendered = render(turns[: u + 1])
        if not rendered.startswith(fed):
            raise DatasetError(f"{path} row {record.row}: field messages: the chat template renders earlier turns "
                               f"differently once user turn {users.index(u) + 1} is added; use chat_turns: last")
        later.append(Turn(encode(tokenizer, rendered[len(fed) :]), list(record.answers) if n == len(asked) else []))
        fed = rendered
    return Prompt(context, encode(tokenizer, question), encode(tokenizer, suffix), tuple(later), head=prefix, prefix=prefix)


def kept_prefix(tokenizer, prompt: Prompt, before_context: str, question: str) -> int:
    """The context tokens before the document: the chat template's head and the template's text before {context},
    as they tokenize alone; where the text's last token would merge with the document's first, up to that token."""
    ids = encode(tokenizer, chat_pieces(tokenizer, before_context, question)[0])
    return next((i for i, (a, b) in enumerate(zip(prompt.context, ids)) if a != b), min(len(prompt.context), len(ids)))
