"""Heads counted under every ablation, and whether a sparse copy keeps each task's gap: the
scoring and sweep steps as the workflow runs them (one scoring job for every ablation, one sweep
per ablation), on a tiny random Llama with SmolLM2's tokenizer (conftest.tiny_base), its copies
made here, and the heads-vs-density step over them."""

import json
import shutil

import numpy as np
import pandas as pd
import pytest
import torch

from attnlab import steps
from attnlab.circuits.task_gap import KEPT_GAP_FLOOR, kept_gap

ABLATIONS = ["corrupted", "mean", "zero"]
# IOI has 30 template variants: 64 pairs give every variant two or three, so that among the 32
# counted prompts templates repeat.
N_PROMPTS, HEADS = 64, 2 * 4
BOOTSTRAP = {"n_resamples": 300, "confidence": 0.9, "seed": 0}  # not the default level: the hand check reads it
MEAN_POOL = 64  # mean ablation's reference: IOI's 30 variants two or three times each, apart from the 64
SCORING = {"seed": 0, "ranking": "exact", "exact": True, "rank_share": 0.5, "batch_size": 64, "device": "cpu",
           "n": N_PROMPTS, "mean_pool": MEAN_POOL}
SWEEP = {"seed": 0, "ranking": "exact", "batch_size": 64, "device": "cpu", "all_k_up_to": 300, "log_points": 40,
         "search": "rounds", "coarse_points": 16, "threshold": 0.9, "sweep_other_ranking": True, "mean_pool": MEAN_POOL,
         "mib_sizes": True,
         "bootstrap": {key: BOOTSTRAP[key] for key in ("n_resamples", "confidence")}}


def _score_and_sweep(model_dir, out, ablations=ABLATIONS) -> dict:
    """score_heads once for every ablation, then sweep_heads per ablation, as the rules lay them out:
    out/prompts.json, out/scores.json, out/{ablation}/scores.csv, sweep.csv, sweep.json,
    per_prompt.parquet. Returns {ablation: {sweep, summary, per_prompt}} paths."""
    scores = {ablation: str(out / ablation / "scores.csv") for ablation in ablations}
    means = str(out / "mean" / "means.safetensors") if "mean" in ablations else None
    steps.score_heads(str(model_dir), "ioi", {**SCORING, "ablations": ablations}, str(out / "prompts.json"), scores,
                      str(out / "scores.json"), threads=torch.get_num_threads(), means_path=means)
    swept = {}
    for ablation in ablations:
        swept[ablation] = {"sweep": out / ablation / "sweep.csv", "summary": out / ablation / "sweep.json",
                           "per_prompt": out / ablation / "per_prompt.parquet"}
        steps.sweep_heads(str(model_dir), "ioi", {**SWEEP, "ablation": ablation}, str(out / "prompts.json"),
                          scores[ablation], str(out / "scores.json"), {k: str(v) for k, v in swept[ablation].items()},
                          threads=torch.get_num_threads(), means_path=means if ablation == "mean" else None)
    return swept


def _copy(base, folder, change=None):
    """A "copy" of the tiny model with ``change(model)`` applied to its weights (None: unchanged)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if change is not None:
        with torch.no_grad():
            change(model)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (base / name).exists():
            shutil.copy(base / name, folder / name)
    return folder


def _halve_logits(model):
    # The final norm's weight scales the last hidden state, and the (tied) output projection is
    # linear without a bias: every logit, and so every logit difference, halves.
    model.model.norm.weight.mul_(0.5)


def _zero_one_head(model):
    model.model.layers[1].self_attn.o_proj.weight[:, 8:16] = 0  # layer 1, head 1 (head_dim 8)


@pytest.fixture(scope="module")
def swept(tiny_base, tmp_path_factory):
    """The tiny model and three copies (unchanged, logits halved, one head zeroed), each scored and
    swept under every ablation: {name: {ablation: paths}}."""
    base, _ = tiny_base
    root = tmp_path_factory.mktemp("ablations")
    models = {"dense": base, "same": _copy(base, root / "same"), "halved": _copy(base, root / "halved", _halve_logits),
              "headless": _copy(base, root / "headless", _zero_one_head)}
    return {**{name: _score_and_sweep(folder, root / "results" / name) for name, folder in models.items()},
            "dense_folder": base}


def test_one_scoring_job_scores_every_head_under_every_ablation(swept):
    folder = swept["dense"]["corrupted"]["summary"].parent.parent
    scoring = json.loads((folder / "scores.json").read_text())
    assert scoring["ablations"] == ABLATIONS and set(scoring["by_ablation"]) == set(ABLATIONS)
    assert len(scoring["ranked_on"]) == len(scoring["counted_on"]) == N_PROMPTS // 2
    exact = {}
    for ablation in ABLATIONS:
        scores = pd.read_csv(folder / ablation / "scores.csv")
        assert len(scores) == HEADS and sorted(scores["rank"]) == list(range(1, HEADS + 1))
        assert scores.sort_values("rank")["exact"].is_monotonic_decreasing
        exact[ablation] = scores.set_index(["layer", "head"])["exact"].sort_index()
    # the reference differs, so do the scores: each ablation was scored against its own
    assert not np.allclose(exact["corrupted"], exact["zero"]) and not np.allclose(exact["corrupted"], exact["mean"])


def test_every_ablations_sweep_runs_from_none_kept_to_all_on_the_counted_prompts(swept):
    scoring = json.loads((swept["dense"]["corrupted"]["summary"].parent.parent / "scores.json").read_text())
    clean = None
    for ablation, paths in swept["dense"].items():
        summary = json.loads(paths["summary"].read_text())
        curve = pd.read_csv(paths["sweep"])
        assert summary["ablation"] == ablation and summary["n_prompts_counted_on"] == N_PROMPTS // 2
        for _, ranking in curve.groupby("ranking"):
            assert list(ranking["heads_kept"]) == list(range(HEADS + 1))  # every k of 8 heads
            assert ranking["explained_effect"].iloc[0] == 0 and ranking["explained_effect"].iloc[-1] == 1
        rows = pd.read_parquet(paths["per_prompt"])
        assert sorted(rows["prompt"].unique()) == scoring["counted_on"]
        # the unpatched model's metric on each counted prompt is the sweep's own with every head kept
        every = rows[(rows["ranking"] == "exact") & (rows["heads_kept"] == HEADS)].sort_values("prompt")
        np.testing.assert_allclose(summary["clean_metric_per_prompt"], every["metric"], atol=1e-5)
        clean = clean or summary["clean_metric_per_prompt"]
        assert summary["clean_metric_per_prompt"] == clean  # the same under every ablation
    # patched from the corrupted run with every head ablated, each prompt is its corrupted run
    corrupted = json.loads(swept["dense"]["corrupted"]["summary"].read_text())
    rows = pd.read_parquet(swept["dense"]["corrupted"]["per_prompt"])
    none = rows[(rows["ranking"] == "exact") & (rows["heads_kept"] == 0)].sort_values("prompt")
    np.testing.assert_allclose(corrupted["corrupted_metric_per_prompt"], none["metric"], atol=1e-4)


def test_without_the_other_ranking_the_configured_ones_sweep_is_unchanged(swept, tmp_path):
    """sweep_other_ranking: false sweeps exact alone, with the same curve and count as beside
    attribution; the scoring's Spearman of the two rankings is still reported."""
    both = swept["dense"]["corrupted"]
    folder = both["summary"].parent.parent
    alone = {"sweep": tmp_path / "sweep.csv", "summary": tmp_path / "sweep.json",
             "per_prompt": tmp_path / "per_prompt.parquet"}
    steps.sweep_heads(str(swept["dense_folder"]), "ioi", {**SWEEP, "ablation": "corrupted", "sweep_other_ranking": False},
                      str(folder / "prompts.json"), str(folder / "corrupted" / "scores.csv"),
                      str(folder / "scores.json"), {k: str(v) for k, v in alone.items()},
                      threads=torch.get_num_threads())
    curve, summary = pd.read_csv(alone["sweep"]), json.loads(alone["summary"].read_text())
    assert set(curve["ranking"]) == {"exact"} and set(summary["rankings"]) == {"exact"}
    reference = pd.read_csv(both["sweep"])
    pd.testing.assert_frame_equal(curve, reference[reference["ranking"] == "exact"].reset_index(drop=True))
    beside = json.loads(both["summary"].read_text())
    assert set(beside["rankings"]) == {"exact", "attribution"}
    assert summary["heads_interval"] == beside["heads_interval"]
    assert summary["spearman_attribution_vs_exact"] == beside["spearman_attribution_vs_exact"] is not None


def _density_table(swept, tmp_path, copy: str) -> pd.DataFrame:
    """heads_vs_density over the dense model and one copy, every ablation, as the rule calls it."""
    keys = {f"{name}/ioi/{ablation}": paths for name in ("dense", copy) for ablation, paths in swept[name].items()}
    (tmp_path / "density.json").write_text(json.dumps({"heldout_density": 0.3, "heldout_kl": 0.05}))
    steps.heads_vs_density({key: str(p["summary"]) for key, p in keys.items()},
                           {key: str(p["sweep"]) for key, p in keys.items()},
                           {key: str(p["per_prompt"]) for key, p in keys.items()},
                           {copy: str(tmp_path / "density.json")}, [["dense", copy]], {"ioi": N_PROMPTS},
                           BOOTSTRAP, str(tmp_path / "table.csv"), str(tmp_path / "figure.png"), 50)
    assert (tmp_path / "figure.png").stat().st_size > 0
    return pd.read_csv(tmp_path / "table.csv")


def test_a_copy_that_keeps_half_the_gap_has_lost_the_task_under_every_ablation(swept, tmp_path):
    table = _density_table(swept, tmp_path, "halved")
    assert sorted(zip(table["label"], table["ablation"])) == sorted(
        (name, ablation) for name in ("dense", "halved") for ablation in ABLATIONS)
    copy = table[table["label"] == "halved"]
    # every logit halved: each prompt's clean − corrupted gap halves, so does every resample's
    np.testing.assert_allclose(copy[["kept_gap", "kept_gap_low", "kept_gap_high"]].to_numpy(), 0.5, atol=1e-4)
    assert copy["task_lost"].tolist() == [True] * 3 and copy["kept_gap_paired"].all()
    dense = table[table["label"] == "dense"]
    assert dense["kept_gap"].isna().all() and (dense["gap_dense"] == copy["gap_dense"].to_numpy()).all()


def test_an_unchanged_copy_keeps_the_whole_gap(swept, tmp_path):
    table = _density_table(swept, tmp_path, "same").set_index(["label", "ablation"])
    for ablation in ABLATIONS:
        row = table.loc[("same", ablation)]
        assert row["kept_gap"] == pytest.approx(1) and row["task_lost"] == False  # noqa: E712 (read from CSV)
        assert row["heads_fewer"] == 1.0  # the same model: the same count


def test_the_kept_gap_and_its_interval_by_hand_from_the_per_prompt_metrics(swept, tmp_path):
    """A copy whose gap changes prompt by prompt (one head zeroed): the gap over the counted
    prompts of the copy over the dense model's, and its paired interval at the configured level,
    recomputed here from the two sweep.json files."""
    table = _density_table(swept, tmp_path, "headless").set_index(["label", "ablation"])
    dense = json.loads(swept["dense"]["corrupted"]["summary"].read_text())
    copy = json.loads(swept["headless"]["corrupted"]["summary"].read_text())
    gaps = {name: np.subtract(s["clean_metric_per_prompt"], s["corrupted_metric_per_prompt"])
            for name, s in (("dense", dense), ("copy", copy))}
    kept = gaps["copy"].mean() / gaps["dense"].mean()
    draws = np.random.default_rng(BOOTSTRAP["seed"]).integers(0, len(gaps["dense"]),
                                                              (BOOTSTRAP["n_resamples"], len(gaps["dense"])))
    # a resample whose dense gap is not positive has no share to keep: left out, and counted
    defined = [rows for rows in draws if gaps["dense"][rows].mean() > 0]
    resampled = np.sort([gaps["copy"][rows].mean() / gaps["dense"][rows].mean() for rows in defined])
    tail = (1 - BOOTSTRAP["confidence"]) / 2
    low, high = np.quantile(resampled, tail, method="lower"), np.quantile(resampled, 1 - tail, method="higher")
    row = table.loc[("headless", "corrupted")]
    assert row["gap_dense"] == pytest.approx(gaps["dense"].mean()) and row["gap_copy"] == pytest.approx(gaps["copy"].mean())
    assert row["kept_gap"] == pytest.approx(kept) and kept != pytest.approx(1, abs=1e-3)
    assert (row["kept_gap_low"], row["kept_gap_high"]) == (pytest.approx(low), pytest.approx(high))
    assert row["kept_gap_undefined_resamples"] == len(draws) - len(defined)
    assert row["task_lost"] == (kept < KEPT_GAP_FLOOR)


def test_the_pruning_figure_says_what_the_copy_keeps(swept, tmp_path, monkeypatch):
    from attnlab.plots import circuits as plots_circuits

    drawn, original = [], plots_circuits._save
    monkeypatch.setattr(plots_circuits, "_save", lambda fig, path, dpi: drawn.append(fig) or original(fig, path, dpi))
    inputs = {name: {k: str(v) for k, v in swept[name]["mean"].items()} for name in ("dense", "halved")}
    steps.plot_pruning(inputs, tmp_path / "mean.png", "ioi", ["dense", "halved"], 0.9, "mean", "exact", BOOTSTRAP,
                       50, copies=[["dense", "halved"]])
    words = " ".join(" ".join(text.get_text() for text in drawn[-1].texts).split())  # the lines wrapped, joined
    assert "halved keeps 50% [50%, 50%] of dense's clean−corrupted gap (< 80%: the task is lost)" in words
    assert "ablation = mean" in drawn[-1].axes[0].get_title()


def test_the_kept_gap_needs_per_prompt_metrics_and_pairs_only_the_same_prompts():
    from attnlab.circuits.counting import Bootstrap

    bootstrap = Bootstrap(200, 0.95, 0)
    assert np.isnan(kept_gap({}, {"clean_metric_per_prompt": [1.0]}, bootstrap)["kept_gap"])  # an older sweep.json
    dense = {"clean_metric_per_prompt": [3.0, 5.0], "corrupted_metric_per_prompt": [1.0, 1.0],
             "counted_prompts_digest": "a"}
    flipped = {"clean_metric_per_prompt": [0.0, 0.0], "corrupted_metric_per_prompt": [1.0, 2.0],
               "counted_prompts_digest": "a"}
    gap = kept_gap(dense, flipped, bootstrap)  # a copy whose gap changed sign keeps less than nothing
    assert gap["kept_gap"] == pytest.approx(-1.5 / 3) and gap["task_lost"] and gap["kept_gap_paired"]
    with pytest.raises(ValueError, match="same prompts"):
        kept_gap(dense, {**flipped, "clean_metric_per_prompt": [0.0], "corrupted_metric_per_prompt": [1.0]},
                 bootstrap)


def test_a_base_that_fails_the_task_has_no_share_of_its_gap_to_keep():
    """A negative base gap would make a copy that fails worse (gap −2 over −1) look like one that
    keeps twice the task: no kept gap, and the figure says why. Resamples whose base gap is not
    positive are left out of the interval and counted, by hand: prompts (gap) 3 and −4, paired."""
    from attnlab.circuits.counting import Bootstrap
    from attnlab.circuits.task_gap import kept_gap_text

    bootstrap = Bootstrap(400, 0.95, 0)
    failing = {"clean_metric_per_prompt": [0.0, 0.0], "corrupted_metric_per_prompt": [1.0, 1.0],
               "counted_prompts_digest": "a"}
    worse = {"clean_metric_per_prompt": [0.0, 0.0], "corrupted_metric_per_prompt": [2.0, 2.0],
             "counted_prompts_digest": "a"}
    gap = kept_gap(failing, worse, bootstrap)
    assert gap["gap_dense"] == -1 and gap["gap_copy"] == -2
    assert np.isnan(gap["kept_gap"]) and gap["task_lost"] is None
    assert kept_gap_text("copy", "dense", gap) == "dense's clean−corrupted gap is -1, not positive: no share of it to keep"

    dense = {"clean_metric_per_prompt": [4.0, -3.0, 4.0], "corrupted_metric_per_prompt": [1.0, 1.0, 1.0],
             "counted_prompts_digest": "a"}  # gaps 3, −4, 3: mean 2/3 > 0
    copy = {**dense, "clean_metric_per_prompt": [2.5, -3.0, 2.5]}  # gaps 1.5, −4, 1.5
    gap = kept_gap(dense, copy, bootstrap)
    draws = bootstrap.draws(3)
    base = np.array([3.0, -4.0, 3.0])[draws].mean(-1)
    ratio = np.array([1.5, -4.0, 1.5])[draws].mean(-1) / base
    defined = np.sort(ratio[base > 0])
    assert gap["kept_gap_undefined_resamples"] == int((base <= 0).sum()) > 0
    assert gap["kept_gap"] == pytest.approx((-1 / 3) / (2 / 3))
    assert gap["kept_gap_low"] == np.quantile(defined, 0.025, method="lower")
    assert gap["kept_gap_high"] == np.quantile(defined, 0.975, method="higher")


def test_mean_ablation_takes_its_means_from_a_pool_apart_from_the_ranked_and_counted_prompts(swept, tiny_base):
    """The template means come from MEAN_POOL prompts drawn with another seed, none of them a prompt
    ranked or counted on (a mean that held the ablated prompt would ablate it in part), the same
    pool in the scoring and the sweep job; scores.json and sweep.json say how many and from what."""
    from collections import Counter

    from attnlab.groundtruth.pairs import prompts_for
    from attnlab.models import load_model
    from attnlab.patching.heads import build_batch, template_means
    from attnlab.patching.tasks import TaskPrompts
    from attnlab.steps.circuits import _task_means
    from attnlab.tokenization import load_tokenizer

    base, _ = tiny_base
    folder = swept["dense"]["mean"]["summary"].parent.parent
    task = TaskPrompts(**json.loads((folder / "prompts.json").read_text()))
    tokenizer = load_tokenizer(str(base))
    model = load_model(str(base), torch.device("cpu"), torch.float32)
    means = _task_means(model, "ioi", task, tokenizer, 16, MEAN_POOL, 0, str(base))
    # by hand: the generator's prompts at another seed, the task's own removed
    drawn = prompts_for("ioi", tokenizer, MEAN_POOL, means.seed, str(base))
    assert means.seed != 0
    keep = [i for i, text in enumerate(drawn.clean) if text not in set(task.clean)]
    pool = TaskPrompts("ioi", [drawn.clean[i] for i in keep], [drawn.corrupted[i] for i in keep],
                       [drawn.templates[i] for i in keep], [drawn.answers[i] for i in keep],
                       [drawn.distractors[i] for i in keep])
    assert not set(pool.clean) & set(task.clean) and means.pool == len(pool.clean) >= MEAN_POOL - 2
    expected = template_means(model, build_batch(pool, tokenizer), 16)
    assert set(means.by_template) == set(expected) >= set(task.templates)
    for template, layers in expected.items():
        for got, want in zip(means.by_template[template], layers):
            torch.testing.assert_close(got, want)
    assert means.fewest == min(Counter(pool.templates).values()) >= 2
    # the task's own prompts would give other means: the pool is not the task
    own = template_means(model, build_batch(task, tokenizer), 16)
    assert not torch.allclose(own[task.templates[0]][0], expected[task.templates[0]][0])
    for path in (folder / "scores.json", swept["dense"]["mean"]["summary"]):
        recorded = json.loads(path.read_text())["mean_over"]
        assert recorded["prompts"] == means.pool and recorded["seed"] == means.seed and "apart" in recorded["what"]


def test_the_mean_sweep_counts_with_the_scoring_jobs_reference_bit_for_bit(swept, tiny_base):
    """The scoring job's means file holds the held-apart means taken again, to the bit, and the mean
    sweep's numbers rest on them: with no head kept, each counted prompt's metric is the one a
    patcher given the means taken here measures (a file read back wrong would differ)."""
    from safetensors.torch import load_file

    from attnlab.models import load_model
    from attnlab.patching.heads import Patcher, build_batch
    from attnlab.patching.tasks import TaskPrompts, subset
    from attnlab.steps.circuits import _task_means
    from attnlab.tokenization import load_tokenizer

    base, _ = tiny_base
    folder = swept["dense"]["mean"]["summary"].parent.parent
    task = TaskPrompts(**json.loads((folder / "prompts.json").read_text()))
    tokenizer = load_tokenizer(str(base))
    model = load_model(str(base), torch.device("cpu"), torch.float32)
    again = _task_means(model, "ioi", task, tokenizer, SCORING["batch_size"], MEAN_POOL, 0, str(base))
    stored = load_file(folder / "mean" / "means.safetensors")
    templates = list(again.by_template)
    assert len(stored) == len(templates) * len(again.by_template[templates[0]])
    for index, template in enumerate(templates):
        for layer, mean in enumerate(again.by_template[template]):
            assert torch.equal(stored[f"{index}/{layer}"], mean)
    counted_on = json.loads((folder / "scores.json").read_text())["counted_on"]
    patcher = Patcher(model, build_batch(subset(task, counted_on), tokenizer), "mean", 16, means=again.by_template)
    _, metrics = patcher.per_prompt(torch.zeros(patcher.gates.n_layers, patcher.gates.n_heads))
    rows = pd.read_parquet(swept["dense"]["mean"]["per_prompt"]).query("heads_kept == 0 and ranking == 'exact'")
    assert rows["prompt"].tolist() == counted_on
    np.testing.assert_allclose(rows["metric"], metrics, rtol=0, atol=1e-5)


def test_the_sweep_refuses_the_scoring_jobs_reference_under_another_pool_and_writes_nothing(swept, tmp_path):
    folder = swept["dense"]["mean"]["summary"].parent.parent
    outputs = {name: str(tmp_path / f"{name}.out") for name in ("sweep", "summary", "per_prompt")}
    with pytest.raises(ValueError, match="pool_asked 64 in the file, 65 asked for"):
        steps.sweep_heads(str(swept["dense_folder"]), "ioi", {**SWEEP, "ablation": "mean", "mean_pool": MEAN_POOL + 1},
                          str(folder / "prompts.json"), str(folder / "mean" / "scores.csv"), str(folder / "scores.json"),
                          outputs, threads=torch.get_num_threads(),
                          means_path=str(folder / "mean" / "means.safetensors"))
    assert not list(tmp_path.iterdir())


def test_a_mean_pool_too_small_for_the_tasks_templates_is_refused_naming_the_setting():
    from attnlab.patching.tasks import TaskError, TaskPrompts, held_apart

    task = TaskPrompts("docstring", ["a", "b", "c"], ["a'", "b'", "c'"], [0, 1, 2], [1, 1, 1], [[2], [2], [2]])
    pool = TaskPrompts("docstring", ["a", "d", "e", "f", "g"], ["a'", "d'", "e'", "f'", "g'"], [0, 0, 1, 1, 2],
                       [1] * 5, [[2]] * 5)
    with pytest.raises(TaskError, match=r"fewer than 2 prompts of template\(s\) \{0: 1, 2: 1\}.*pruning.mean_pool \(now 5\)"):
        held_apart(pool, task)
    kept = held_apart(pool, task, at_least=1)
    assert kept.clean == ["d", "e", "f", "g"] and kept.templates == [0, 1, 1, 2]


def test_only_the_jobs_that_take_a_mean_read_the_mean_pool():
    """Snakemake reruns a job whose params change: a new mean_pool must rerun the mean sweeps and
    the scoring jobs that score under mean ablation, and nothing else."""
    from attnlab.config.settings import scoring_params, sweep_params

    pruning = {**SCORING, **SWEEP, "tasks": {"ioi": {"n": 64}}, "mean_pool": 99}
    assert sweep_params(pruning, "mean")["mean_pool"] == 99
    assert sweep_params(pruning, "corrupted")["mean_pool"] is None
    assert scoring_params(pruning, "ioi", ["corrupted", "mean"])["mean_pool"] == 99
    assert scoring_params(pruning, "ioi", ["corrupted", "zero"])["mean_pool"] is None
