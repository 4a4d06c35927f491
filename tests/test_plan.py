"""Parse-time decisions (attnlab.plan), reached without Snakemake."""

from attnlab.plan import comparison_pairs


def test_comparison_pairs_accept_one_pair_a_list_of_pairs_or_nothing():
    assert comparison_pairs(["a", "b"], ["a", "b", "c"]) == [("a", "b")]
    assert comparison_pairs([["a", "a-sparse"], ["c", "b"]], ["a"]) == [("a", "a-sparse"), ("c", "b")]
    assert comparison_pairs(None, ["x", "y", "z"]) == [("x", "y")]
    assert comparison_pairs(None, ["x"]) == []
