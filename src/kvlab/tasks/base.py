"""What a task generator produces: prompts split where compression happens, with gold answers."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Prompt:
    """A chat prompt cut into the three pieces the engine needs.

    ``context`` is always compressed; ``question`` is compressed only in question-aware mode;
    ``suffix`` (the chat template's end of turn + assistant header) is never compressed.
    Each is a list of token ids; their concatenation is the whole prompt.
    """

    context: list[int]
    question: list[int]
    suffix: list[int]

    @property
    def tokens(self) -> int:
        return len(self.context) + len(self.question) + len(self.suffix)


@dataclass(frozen=True)
class Sample:
    task: str
    sample_id: str
    context_tokens: int  # the target length
    depth: float
    seed: int
    prompt: Prompt
    gold: list[str]
    metric: str = "string_match_all"
    meta: dict = field(default_factory=dict)

    def row(self) -> dict:
        """The columns every result row of this sample carries."""
        return {
            "task": self.task,
            "sample_id": self.sample_id,
            "context_tokens": self.context_tokens,
            "prompt_tokens": self.prompt.tokens,
            "depth": self.depth,
            "seed": self.seed,
            "gold": list(self.gold),
            "metric": self.metric,
        }

    def to_dict(self) -> dict:
        return asdict(self)


def split_chat(tokenizer, user_text_before: str, user_text_question: str) -> tuple[str, str, str]:
    """Apply the chat template to one user turn; return (prefix+text, question, suffix) as strings.

    The template is rendered around a marker so the pieces are cut exactly where the template puts them.
    """
    marker = "\x00KVLAB-SPLIT\x00"
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": user_text_before + marker + user_text_question + marker}],
        add_generation_prompt=True,
        tokenize=False,
    )
    head, question, suffix = rendered.split(marker)
    return head, question, suffix


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)
