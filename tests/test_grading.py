import math
from pathlib import Path

import numpy as np
import pytest

from attnlab.reasoning.grading import (bootstrap_ci, bootstrap_cis, extract_answer, grade_lenient, grade_math_verify,
                                       last_boxed, normalise_lenient)


@pytest.mark.parametrize("text, expected", [
    (r"so \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),
    (r"\boxed{1} then \boxed{2}", "2"),
    (r"\boxed{\left( 3, \frac{\pi}{2} \right)}", r"\left( 3, \frac{\pi}{2} \right)"),
    (r"\fbox{7}", "7"),
    (r"\boxed{\frac{1}{2}", None),  # cut off: unbalanced
    ("no box here", None),
])
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


def test_extract_answer_order():
    assert extract_answer(r"3 apples, \boxed{4}, 5") == ("4", "boxed")
    assert extract_answer("so she earns\n#### 1,200\n") == ("1,200", "hash")
    assert extract_answer("5 + 7 = 12 dollars") == ("12", "last_number")
    assert extract_answer("cost is 1,250.50 total") == ("1250.50", "last_number")
    assert extract_answer("no digits", fallback="last_number") == (None, "none")
    assert extract_answer("answer 12", fallback="none") == (None, "none")


@pytest.mark.parametrize("gold, pred, correct", [
    (r"\frac{1}{2}", "0.5", True),
    (r"\frac{1}{2}", "1/2", True),
    (r"\dfrac{3}{4}", r"\frac{3}{4}", True),
    ("10", "10.0", True),
    ("1,000", "1000", True),
    (r"\left( 3, \frac{\pi}{2} \right)", r"(3, \frac{\pi}{2})", True),
    ("[2,5)", "[2, 5)", True),
    ("[2,5)", "(2, 5)", False),          # open vs half-open interval
    (r"\text{(C)}", "C", True),
    (r"\$18", "18", True),
    ("3", "4", False),
    ("18", None, False),
    ("18", "", False),
])
def test_math_verify(gold, pred, correct):
    assert grade_math_verify(gold, pred) is correct


@pytest.mark.parametrize("gold, pred, correct", [
    (r"\frac{1}{2}", r"\dfrac{1}{2}", True),
    (r"\text{Evelyn}", "Evelyn", True),
    (r"90^\circ", "90", True),
    ("10", "1", True),         # the paper's substring rule is this lenient
    (r"\frac{1}{2}", "0.5", False),  # no numeric equivalence
    ("10", "", False),         # "" would be a substring of anything
    ("10", None, False),
    ("10", float("nan"), False),
])
def test_lenient(gold, pred, correct):
    assert grade_lenient(gold, pred) is correct


def test_normalise_lenient():
    assert normalise_lenient(r"\left( 3, \frac{\pi}{2} \right).") == r"(3,\frac{\pi}{2})"
    assert normalise_lenient(r"$5\%$") == "5"


def test_bootstrap_ci_brackets_the_mean_and_is_seeded():
    values = [1, 0, 1, 1, 0, 0, 1, 0, 1, 1]
    low, high = bootstrap_ci(values, 0.95, 1000, seed=0)
    assert low < 0.6 < high
    assert (low, high) == bootstrap_ci(values, 0.95, 1000, seed=0)
    assert bootstrap_ci([1, 1, 1], 0.95, 1000, 0) == (1.0, 1.0)


def test_the_bootstrap_intervals_level_is_95_percent():
    """400 fair coin flips: the percentile interval of the mean spans ±1.96 standard errors
    (0.098 wide); a 90% level would span ±1.645 (0.082): the level is pinned, not assumed."""
    values = np.random.default_rng(0).integers(0, 2, 400)
    low, high = bootstrap_ci(values, 0.95, 20000, seed=0)
    standard_error = values.std() / np.sqrt(len(values))
    assert (high - low) == pytest.approx(2 * 1.959964 * standard_error, rel=0.04)


def test_rows_bootstrapped_together_get_each_rows_own_interval():
    """bootstrap_cis (the attention figures' bands, a few hundred positions per call) gives each
    row what bootstrap_ci gives it alone, to the last bit, constant rows included."""
    rng = np.random.default_rng(3)
    samples = np.vstack([rng.random((40, 6)), np.full((1, 6), 0.1), rng.integers(0, 2, (5, 6))])
    low, high = bootstrap_cis(samples, 0.95, 1000, seed=0)
    for row, (row_low, row_high) in zip(samples, zip(low, high)):
        assert (row_low, row_high) == bootstrap_ci(row, 0.95, 1000, seed=0)
    assert (low[40], high[40]) == (0.1, 0.1)


def test_summary_says_where_answers_came_from_and_how_many_hit_the_limit():
    import pandas as pd

    from attnlab.reasoning.grading import grade_items, summarise

    prompts = pd.DataFrame({"id": list("abcde"), "answer": ["4", "12", "7", "3", "9"], "inserted_tokens": 0})
    responses = [r"so \boxed{4}", "#### 12", "3 + 4 = 7\n7 = 7\n7 = 1", "no digits", r"\boxed{9}"]
    generations = pd.DataFrame({"id": list("abcde"), "response": responses, "n_new_tokens": 8,
                                "hit_token_limit": [False, False, True, True, False]})
    graded = grade_items(prompts, generations, "last_number")
    summary = summarise(graded, 0.95)
    assert (summary["extracted_boxed"], summary["extracted_hash"], summary["extracted_last_number"],
            summary["extracted_none"]) == (0.4, 0.2, 0.2, 0.2)
    assert summary["n_hit_token_limit"] == 2 and summary["hit_token_limit"] == 0.4
    assert summary["math_verify_acc"] == 60.0  # the fallback's "1" is graded wrong


# ---- the lenient grader's two rules, kept apart ----


@pytest.mark.parametrize("gold, pred, rule", [
    ("41", "1", "substring"),             # the embedded default's MATH-500 cells: last-number fallbacks
    ("6+9i", "6", "substring"),
    ("27", "2", "substring"),
    (r"\dfrac{1}{2}", r"\frac{1}{2}", "exact"),
    ("18", "18.", "exact"),
    ("18", "81", "no_match"),
    ("18", "", "no_answer"),
    ("18", None, "no_answer"),
    ("18", "$$", "no_answer"),            # nothing left after normalising
])
def test_lenient_match_names_the_rule(gold, pred, rule):
    from attnlab.reasoning.grading import lenient_match

    assert lenient_match(gold, pred) == rule
    assert grade_lenient(gold, pred) is (rule in ("exact", "substring"))


def test_substring_only_lenient_matches_are_counted_per_cell():
    """Six items: of the lenient grader's three "correct" answers two are substring matches of
    the last-number fallback ("1" for gold 41, "6" for 6+9i); only one is an exact match."""
    import pandas as pd

    from attnlab.reasoning.grading import grade_items, summarise

    gold = ["41", "6+9i", "27", "12", r"\frac{3}{4}", "5"]
    responses = ["so we get 1", "the real part is 6", "#### 2x", "answer 13", "no digits", r"\boxed{5}"]
    prompts = pd.DataFrame({"id": list("abcdef"), "answer": gold, "inserted_tokens": 55})
    generations = pd.DataFrame({"id": list("abcdef"), "response": responses, "n_new_tokens": 9,
                                "hit_token_limit": False})
    graded = grade_items(prompts, generations, "last_number")
    assert graded["lenient_rule"].tolist() == ["substring", "substring", "no_match", "no_match",
                                               "no_answer", "exact"]
    assert graded["lenient"].tolist() == [True, True, False, False, False, True]
    assert list(graded.columns[-2:]) == ["lenient", "lenient_rule"]  # earlier columns keep their places
    summary = summarise(graded, 0.95)
    assert summary["lenient_acc"] == pytest.approx(50.0)
    assert summary["lenient_substring_only"] == 2
    assert summary["lenient_exact_acc"] == pytest.approx(100 / 6)
    assert summary["math_verify_acc"] == pytest.approx(100 / 6)


def test_a_cell_without_items_summarises_to_no_accuracy():
    import pandas as pd

    from attnlab.reasoning.grading import grade_items, summarise

    prompts = pd.DataFrame({"id": [], "answer": [], "inserted_tokens": []})
    generations = pd.DataFrame({"id": [], "response": [], "n_new_tokens": [], "hit_token_limit": []})
    summary = summarise(grade_items(prompts, generations, "last_number"),
                        0.95)
    assert summary["n"] == 0 and summary["lenient_substring_only"] == 0
    assert math.isnan(summary["lenient_acc"]) and math.isnan(summary["math_verify_acc"])


def test_accuracy_table_keeps_earlier_columns_in_place(tmp_path):
    """The substring counts are new columns at the end; every earlier column and value stays."""
    import pandas as pd

    from attnlab import io, steps
    from attnlab.reasoning.grading import grade_items, summarise

    prompts = pd.DataFrame({"id": ["a", "b"], "answer": ["41", "7"], "inserted_tokens": 0})
    generations = pd.DataFrame({"id": ["a", "b"], "response": ["so 1", r"\boxed{7}"], "n_new_tokens": 5,
                                "hit_token_limit": False})
    summary = {"model": "m", "dataset": "d", "condition": "none",
               **summarise(grade_items(prompts, generations, "last_number"),
                           0.95)}
    before = {k: v for k, v in summary.items() if k not in steps.LATER_COLUMNS}
    io.write_json(before, tmp_path / "before.json")
    io.write_json(summary, tmp_path / "after.json")
    steps.accuracy_table([str(tmp_path / "before.json")], tmp_path / "before.csv")
    steps.accuracy_table([str(tmp_path / "after.json")], tmp_path / "after.csv")
    old, new = pd.read_csv(tmp_path / "before.csv"), pd.read_csv(tmp_path / "after.csv")
    assert list(new.columns) == list(old.columns) + ["lenient_substring_only", "lenient_exact_acc"]
    pd.testing.assert_frame_equal(new[old.columns], old)
    assert new.loc[0, "lenient_substring_only"] == 1 and new.loc[0, "lenient_acc"] == 100.0


def test_a_prompt_without_a_generation_fails_naming_its_id():
    import pandas as pd

    from attnlab.reasoning.grading import grade_items

    prompts = pd.DataFrame({"id": ["a", "b", "c"], "answer": ["1", "2", "3"], "inserted_tokens": 0})
    generations = pd.DataFrame({"id": ["a", "c"], "response": ["1", "3"], "n_new_tokens": 1,
                                "hit_token_limit": False})
    with pytest.raises(ValueError, match=r"1 prompts have no generation \(ids \['b'\]\)"):
        grade_items(prompts, generations, "last_number")
    assert len(grade_items(prompts.iloc[[0, 2]], generations, "last_number")) == 2


def test_a_second_configs_accuracy_table_names_its_config_and_logs_the_rows_it_replaces(tmp_path, caplog):
    """Two configs in turn write results/tables/accuracy.csv: each row says which config it holds,
    and the second run's log names every row of the first's it dropped or rewrote."""
    import logging

    import pandas as pd

    from attnlab import io, steps
    from attnlab.config.plan import config_label

    def cell(condition, acc):
        summary = {"model": "m", "dataset": "d", "condition": condition, "n": 4, "math_verify_acc": acc}
        path = tmp_path / f"{condition}-{acc}.json"
        io.write_json(summary, path)
        return str(path)
    table = tmp_path / "accuracy.csv"
    steps.accuracy_table([cell("none", 25.0), cell("mless", 50.0)], str(table), config=config_label([]))
    with caplog.at_level(logging.WARNING, logger="attnlab"):
        steps.accuracy_table([cell("none", 75.0), cell("q55", 0.0)], str(table),
                             config=config_label(["config/mechanism.yaml"]))
    rows = pd.read_csv(table)
    assert rows["config"].tolist() == ["mechanism", "mechanism"]
    messages = caplog.text
    assert "no longer holds the row {'model': 'm', 'dataset': 'd', 'condition': 'mless'} of the last table (config config)" in messages
    assert "rewrites the row {'model': 'm', 'dataset': 'd', 'condition': 'none'}" in messages
    assert "q55" not in messages  # a new row is no one's loss


def _wilson_by_hand(correct: int, n: int, level: float) -> tuple[float, float]:
    """Wilson's score interval from its formula: centre (p + z²/2n) / (1 + z²/n), half-width
    z √(p(1 − p)/n + z²/4n²) / (1 + z²/n), z the normal quantile of the level's upper tail."""
    from scipy.stats import norm

    z, p = norm.ppf(1 - (1 - level) / 2), correct / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def test_the_accuracy_interval_is_wilsons_at_the_configs_level():
    """Five items, math-verify 3 correct, lenient 4 (one substring match): each grader's interval
    ends are Wilson's at the level config/config.yaml gives (the schema's default, 95%), from the
    formula written here and, for 3 of 5, from the published ends [23.07, 88.24]%; at 90% they
    narrow as the formula does (a level fixed inside summarise fails one or the other)."""
    import pandas as pd
    import yaml

    from attnlab.config.schema import validate_config
    from attnlab.reasoning.grading import grade_items, summarise

    repo = Path(__file__).resolve().parents[1]
    config = yaml.safe_load((repo / "config" / "config.yaml").read_text())
    validate_config(config, repo / "config" / "schema.yaml")
    level = config["grading"]["confidence"]
    assert level == 0.95
    prompts = pd.DataFrame({"id": list("abcde"), "answer": ["4", "12", "7", "41", "9"], "inserted_tokens": 0})
    responses = [r"\boxed{4}", r"\boxed{12}", r"\boxed{7}", r"\boxed{1}", r"\boxed{8}"]
    generations = pd.DataFrame({"id": list("abcde"), "response": responses, "n_new_tokens": 8,
                                "hit_token_limit": False})
    graded = grade_items(prompts, generations, "last_number")
    summary = summarise(graded, level)
    assert (summary["math_verify_ci_low"], summary["math_verify_ci_high"]) == pytest.approx((23.07, 88.24), abs=0.005)
    for confidence, got in ((level, summary), (0.90, summarise(graded, 0.90))):
        for grader, correct in (("math_verify", 3), ("lenient", 4)):
            want = [100 * end for end in _wilson_by_hand(correct, 5, confidence)]
            assert [got[f"{grader}_ci_low"], got[f"{grader}_ci_high"]] == pytest.approx(want, abs=1e-9), \
                (grader, confidence)
    assert summary["interval"].endswith("95%")
