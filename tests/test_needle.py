import pytest

from kvlab.tasks import GENERATORS
from kvlab.tasks.needle import QUESTION

SPEC = {"kind": "niah_single", "depths": [0.0, 0.5, 1.0], "samples": 2, "seed": 7}


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return tiny[1]


@pytest.mark.parametrize("target", [512, 1000, 2048])
def test_length_fits_target(tokenizer, target):
    for sample in GENERATORS["niah_single"]("niah_single", SPEC, tokenizer, target):
        # the largest haystack that fits: at most the target, and no whole filler sentence short of it
        assert target - 60 < sample.prompt.tokens <= target


def test_needle_present_once_and_gold_recorded(tokenizer):
    for sample in GENERATORS["niah_single"]("niah_single", SPEC, tokenizer, 1000):
        context = tokenizer.decode(sample.prompt.context)
        (value,) = sample.gold
        assert len(value) == 7 and value.isdigit()
        assert context.count(value) == 1
        assert context.count(f"for {sample.meta['key']} is: {value}.") == 1
        question = tokenizer.decode(sample.prompt.question)
        assert value not in question  # no leak of the answer into the question
        assert sample.meta["key"] in question


def test_depth_places_needle(tokenizer):
    samples = GENERATORS["niah_single"]("niah_single", SPEC, tokenizer, 2048)
    for s in samples:
        n = s.meta["haystack_sentences"]
        assert s.meta["needle_sentence"] == round(s.depth * n)
        context = tokenizer.decode(s.prompt.context)
        pos = context.index(s.gold[0]) / len(context)
        assert abs(pos - s.depth) < 0.2


def test_seeded_and_deterministic(tokenizer):
    a = GENERATORS["niah_single"]("niah_single", SPEC, tokenizer, 1000)
    b = GENERATORS["niah_single"]("niah_single", SPEC, tokenizer, 1000)
    assert [s.to_dict() for s in a] == [s.to_dict() for s in b]
    c = GENERATORS["niah_single"]("niah_single", {**SPEC, "seed": 8}, tokenizer, 1000)
    assert [s.gold for s in a] != [s.gold for s in c]
    assert len({s.gold[0] for s in a}) == len(a)  # samples differ from each other


def test_chat_template_wraps_prompt(tokenizer):
    s = GENERATORS["niah_single"]("niah_single", SPEC, tokenizer, 600)[0]
    assert tokenizer.decode(s.prompt.context).startswith("<|im_start|>user\n")
    assert tokenizer.decode(s.prompt.suffix) == "<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(s.prompt.question).strip() == QUESTION.format(key=s.meta["key"])


def test_too_short_target_is_a_clear_error(tokenizer):
    with pytest.raises(ValueError, match=r"context_tokens 200 is too short; the prompt alone needs \d+ tokens"):
        GENERATORS["niah_single"]("niah_single", SPEC, tokenizer, 200)
