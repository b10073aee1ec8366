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
