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
