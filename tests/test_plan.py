"""Parse-time decisions (attnlab.plan), reached without Snakemake."""

from attnlab.plan import comparison_pairs


def test_comparison_pairs_accept_one_pair_a_list_of_pairs_or_nothing():
    assert comparison_pairs(["a", "b"], ["a", "b", "c"]) == [("a", "b")]
    assert comparison_pairs([["a", "a-sparse"], ["c", "b"]], ["a"]) == [("a", "a-sparse"), ("c", "b")]
    assert comparison_pairs(None, ["x", "y", "z"]) == [("x", "y")]
    assert comparison_pairs(None, ["x"]) == []


def _condition(kind="none", arm=False, placement="between", **extra):
    return {"kind": kind, "arm": arm, "placement": placement, **extra}


def test_families_keep_texts_apart_that_share_their_start():
    from attnlab.plan import family

    start = "An unrelated sentence that goes on"
    one = family(_condition("text", length=20, text=start + " and on"))
    two = family(_condition("text", length=20, text=start + " elsewhere"))
    assert one != two and one.startswith("text: An unrelated")
    assert family(_condition("repeat", length=10, unit="/")) == "repeat '/'"
    assert family(_condition("repeat", length=0, unit="/")) is None
    assert family(_condition("text", length=5)) == "text: default"


def test_length_and_placement_sweeps_are_planned_from_the_conditions():
    from attnlab.plan import has_length_sweep, has_placement_sweep, length_families, placements

    conditions = {
        "none": _condition(),
        "mless": _condition("repeat", length=55, unit="/"),
        "mless_10": _condition("repeat", length=10, unit="/"),
        "mless_end": _condition("repeat", length=55, unit="/", placement="end"),
        "arm": _condition(arm=True),
    }
    families = length_families(conditions)
    assert families == {"none": None, "mless": "repeat '/'", "mless_10": "repeat '/'"}
    assert has_length_sweep(families)
    assert not has_length_sweep({"none": None, "mless": "repeat '/'"})
    where = placements(conditions)
    assert "arm" not in where and where["none"]["placement"] == "none"
    assert where["mless_end"] == {"family": "repeat '/'", "length": 55, "placement": "end"}
    assert has_placement_sweep(where)
    assert not has_placement_sweep({k: v for k, v in where.items() if k != "mless_end"})
