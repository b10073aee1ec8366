import pytest

from kvlab.tasks.scoring import clean, string_match_all, string_match_part


def test_match_all_counts_each_gold():
    assert string_match_all("The numbers are 123 and 456.", ["123", "456"]) == 1.0
    assert string_match_all("Only 123 here", ["123", "456"]) == 0.5
    assert string_match_all("nothing", ["123"]) == 0.0


def test_match_part_any_gold():
    assert string_match_part("it is 456", ["123", "456"]) == 1.0
    assert string_match_part("it is 789", ["123", "456"]) == 0.0


def test_case_and_control_characters():
    assert clean("\x00A\tB\n") == "A\nB"  # RULER: each control character becomes a newline
    assert string_match_all("ANSWER:\x07 Silver-Falcon", ["silver-falcon"]) == 1.0
    # a control character inside the answer breaks the match, as in RULER after stripping
    assert string_match_all("12\x0034", ["1234"]) == 0.0


def test_empty_gold_is_an_error():
    with pytest.raises(ValueError, match="at least one gold"):
        string_match_all("x", [])


def test_last_number_takes_the_final_number():
    from kvlab.tasks.scoring import last_number, score

    assert last_number("3 + 4 = 7, so the answer is 1,234.", ["1234"]) == 1.0
    assert last_number("The answer is 12. Then 13", ["12"]) == 0.0
    assert last_number("no digits", ["5"]) == 0.0
    assert last_number("-3", ["-3"]) == 1.0
    assert score("none", "anything", []) != score("none", "anything", [])  # NaN: not scored


def test_qa_f1_known_values():
    """SQuAD v1.1's F1 by hand: "The cat sat." → [cat, sat]; "cat sat on the mat" → [cat, sat, on, mat]: 2 shared,
    precision 1, recall 1/2, F1 2/3."""
    from kvlab.tasks.scoring import qa_f1

    assert qa_f1("The cat sat.", ["cat sat on the mat"]) == pytest.approx(2 / 3)
    assert qa_f1("An Apple!", ["apple"]) == 1.0  # articles, case and punctuation ignored
    assert qa_f1("dog", ["cat"]) == 0.0
    assert qa_f1("Paris, France", ["London", "Paris"]) == pytest.approx(2 / 3)  # the best gold answer counts
    # tokens count with multiplicity: [red, red, blue] vs [red, blue, blue] share red once and blue once
    assert qa_f1("red red blue", ["red blue blue"]) == pytest.approx(2 / 3)
    assert qa_f1("the a an", ["cat"]) == 0.0  # nothing left after normalization


def test_exact_match_known_values():
    from kvlab.tasks.scoring import exact_match

    assert exact_match("  The Eiffel Tower. ", ["eiffel tower"]) == 1.0
    assert exact_match("Eiffel Tower in Paris", ["Eiffel Tower"]) == 0.0
    assert exact_match("1,000", ["1000"]) == 1.0  # punctuation removed, as SQuAD's normalization does


def test_rouge_l_against_rouge_score_and_the_lcs_by_hand():
    """rouge-score's documented example: the LCS of the 8 prediction tokens and the 9 target tokens has 5 tokens
    (the quick brown ... jumps ... the), so P = 5/8, R = 5/9."""
    from kvlab.tasks.scoring import rouge_l

    p, r = 5 / 8, 5 / 9
    assert rouge_l("The quick brown dog jumps on the log.", ["The quick brown fox jumps over the lazy dog"]) == pytest.approx(2 * p * r / (p + r))
    assert rouge_l("same words here", ["nothing in common", "same words here"]) == 1.0
    assert rouge_l("你好世界", ["你好世界"]) == 0.0  # rouge-score's tokenizer keeps ASCII only
    assert type(rouge_l("你好世界", ["你好世界"])) is float  # rouge-score gives an int 0 for no tokens


@pytest.mark.parametrize("metric", ["qa_f1", "exact_match", "rouge_l"])
def test_the_new_metrics_need_a_gold_answer(metric):
    from kvlab.tasks.scoring import score

    with pytest.raises(ValueError, match=f"^{metric} needs at least one gold answer$"):
        score(metric, "x", [])


def test_paired_bounds_decide_on_continuous_scores():
    """F1 and ROUGE are partial scores in [0, 1]: the decision's bounds take their per-sample differences as they
    take lost answers (kvlab.stats.intervals.drop_bounds)."""
    import numpy as np

    from kvlab.stats.intervals import drop_bounds

    full = np.random.default_rng(0).uniform(0.5, 1.0, 150)
    assert drop_bounds(full, full.copy(), 5.0).decide(5.0) == "safe"
    assert drop_bounds(full, np.clip(full - 0.3, 0, 1), 5.0).decide(5.0) == "unsafe"
    small = np.clip(full - 0.02, 0, 1)  # 2 points lost on every sample: within 5 points
    assert drop_bounds(full, small, 5.0).decide(5.0) == "safe"
