"""What a head sweep's and an MLP-activation job ask for (attnlab.cost.requests): the sweep's k
counted against the sweeps the job runs (``steps.circuits._head_count`` on synthetic curves),
its forwards and the MLP forward's counted by hand."""

import dataclasses
import json

import numpy as np
import pandas as pd
import pytest

from attnlab.circuits.counting import Bootstrap
from attnlab.circuits.curves import k_grid
from attnlab.cost import model as cost, requests
from attnlab.config.settings import Sweep
from attnlab.steps.circuits import _head_count
from test_crossing_search import CurvePatcher
from test_requests import HAND, OLMO, _config_with_olmo

PROMPTS = 24


@pytest.mark.parametrize("n", [1, 2, 5, 40, 64, 65, 270, 1024, 3105])
@pytest.mark.parametrize("max_all, points", [(0, 16), (64, 40), (300, 40), (300, 3)])
def test_the_grid_counted_without_numpy_is_the_sweeps_own(n, max_all, points):
    assert requests.log_grid(n, max_all, points) == k_grid(n, max_all, points)


def _curves(n: int) -> dict:
    """Per-prompt metrics climbing at different k (early, late, in steps), one that dips back
    under the threshold, and one that jumps only at the last heads (the widest bracket)."""
    rng = np.random.default_rng(n)
    heights = rng.uniform(0.6, 1.4, PROMPTS)
    centres = rng.uniform(0.05, 0.5, PROMPTS) * n

    def climbing(k):
        return heights * (1 - np.exp(-k / centres)) / (1 - np.exp(-n / centres))

    def dipping(k):
        return climbing(k) * (1 - 0.3 * np.exp(-((k - 0.4 * n) / (0.05 * n + 1)) ** 2))

    def late(k):
        return heights * (k >= n - 1) + 0.01 * heights * k / n
    return {"climbing": climbing, "dipping": dipping, "late": late}


def _sweep_settings(search: str, **changed) -> Sweep:
    values = dict(seed=0, ablation="corrupted", ranking="exact", sweep_other_ranking=True, mean_pool=None,
                  batch_size=8, device="cpu", all_k_up_to=64, log_points=40, search=search, coarse_points=16,
                  threshold=0.9, bootstrap={"n_resamples": 200, "confidence": 0.95})
    return Sweep(**{**values, **changed})


@pytest.mark.parametrize("search", ["rounds", "bisection"])
@pytest.mark.parametrize("n, all_k_up_to", [(40, 64), (270, 64), (1024, 300)])
def test_a_sweep_measures_at_most_the_ks_its_request_counts(search, n, all_k_up_to):
    """Both rankings of a sweep (the configured one refined, the other on its grid), each on
    curves of every shape: never more k than ``sweep_points`` counts for it."""
    settings = _sweep_settings(search, all_k_up_to=all_k_up_to)
    bootstrap = Bootstrap(200, 0.95, 0)
    order = [(0, h) for h in range(n)]
    for name, metric in _curves(n).items():
        for configured in (True, False):
            patcher = CurvePatcher(metric)
            _head_count(patcher, order, settings, bootstrap, list(range(PROMPTS)), configured)
            bound = requests.sweep_points(n, dataclasses.asdict(settings), configured)
            assert len(patcher.measured) <= bound, (name, configured, len(patcher.measured), bound)  # every forward
            if configured and name == "late" and search == "rounds":  # the widest bracket refined to the head
                grid = k_grid(n, all_k_up_to, settings.log_points)
                assert len(set(patcher.measured)) >= len(grid) + max(np.diff(grid)) - 1


def test_a_sweep_counts_its_forwards_and_resumes_no_head():
    """Only whole forwards: 3 of them (the ablation's references, the clean and corrupted metrics
    of the counted prompts) and one per k (10 here), each over every token of every prompt; 4
    layers of 144 parameters (attention 48, MLP 96), 3 prompts of 5 tokens in batches of 2."""
    work = {"prompts": 3, "batch": 2, "tokens": 5, "forwards": requests.SWEEP_FORWARDS + 10, "exact": False}
    per_row_token = 13 * 4 * 144
    assert cost.time_features("heads", HAND, work) == {"multiply_adds": 3 * 5 * per_row_token,
                                                       "weights_read": 2 * per_row_token}


def test_a_sweep_runs_the_forwards_its_request_counts(tiny_base, monkeypatch):
    """sweep_heads' own forwards besides one per k, counted as the job runs them on a real model:
    ``SWEEP_FORWARDS`` per mini-batch."""
    import torch

    from attnlab.models import load_model
    from attnlab.patching.heads import Patcher, build_batch
    from attnlab.patching.tasks import generate_task
    from attnlab.steps.circuits import _counted_prompts
    from attnlab.tokenization import load_tokenizer

    model_dir, _ = tiny_base
    model = load_model(str(model_dir), torch.device("cpu"), torch.float32)
    tokenizer = load_tokenizer(model_dir)
    calls, forward = [], type(model).forward
    monkeypatch.setattr(type(model), "forward", lambda self, *a, **k: calls.append(1) or forward(self, *a, **k))
    patcher = Patcher(model, build_batch(generate_task("ioi", tokenizer, 4, 0), tokenizer), "corrupted", 2)
    _counted_prompts({"ranked_on": [], "rank_share": 0.5}, generate_task("ioi", tokenizer, 4, 0), patcher)
    assert len(calls) == requests.SWEEP_FORWARDS * 2  # 2 mini-batches of 2 prompts


def test_a_sweep_job_asks_the_heads_fit_for_its_counted_prompts_and_its_ks(tmp_path):
    """OLMo-7B's 1,024 heads, rounds: the configured ranking's grid (40 log points: 37 distinct k,
    with 0 and all, and MIB's sizes: pruning.mib_sizes), every k inside its widest step and 40 more
    for the interval; the other ranking's grid alone."""
    config = _config_with_olmo(tmp_path)
    pruning = config["pruning"] | {"search": "rounds", "all_k_up_to": 300, "log_points": 40, "exact": True,
                                   "ranking": "exact", "sweep_other_ranking": True}
    assert pruning["mib_sizes"]  # the schema's default
    grid = sorted(set(k_grid(1024, 300, 40)) | {1, 2, 5, 10, 20, 51, 102, 204, 512})  # int(share × 1,024)
    widest = max(np.diff(grid))
    assert requests.sweep_points(1024, pruning, True) == len(grid) + widest - 1 + 40
    asked = requests.job_request("sweep_heads", {**config, "pruning": pruning},
                                 {"model": "olmo-shaped", "task": "ioi", "ablation": "corrupted"}, {}, attempt=1,
                                 local=True, batch=2, bases={}, models_dir=str(tmp_path / "m"))
    _, counted = requests.prompt_split(pruning, "ioi")
    work = {"prompts": counted, "batch": min(2, counted), "tokens": 20,
            "forwards": 3 + len(grid) + widest - 1 + 40 + len(grid), "exact": False}
    assert asked.estimate == cost.estimate("heads", OLMO, work, 4, asked.device)
    alone = requests.sweep_work(pruning | {"sweep_other_ranking": False}, "ioi", 2, 1024)
    assert alone["forwards"] == work["forwards"] - len(grid)
    if asked.device == "cpu":
        assert asked.estimate.seconds < cost.estimate("heads", OLMO, work | {"exact": True}, 4, "cpu").seconds


def test_the_mlp_forward_runs_the_layers_up_to_the_recorded_one():
    """Up to layer 1 of 4: 2 layers of 144 parameters per token, and the attention's T x T
    products (2 heads x head dim 2, queries by keys then values), per batch: 3 prompts of 5 tokens in 2."""
    work = {"prompts": 3, "batch": 2, "tokens": 5, "layers_run": 2}
    assert cost.time_features("mlp_activations", HAND, work) == {
        "multiply_adds": 2 * 2 * (5 * 2 * 144 + 2 * 2 * 25 * 2 * 2), "weights_read": 2 * 2 * 144, "runs": 1}


def test_an_mlp_job_reads_its_prompts_up_to_max_prompts(tmp_path):
    config = _config_with_olmo(tmp_path)
    config["mlp"] |= {"max_prompts": 2, "layer": 5}
    prompts = tmp_path / "prompts.parquet"
    wildcards = {"model": "olmo-shaped", "dataset": "math500", "condition": "none"}

    def asked():
        return requests.job_request("mlp_activations", config, wildcards, {"prompts": str(prompts)}, attempt=1,
                                    local=True, batch=8, bases={}, models_dir=str(tmp_path / "models"))
    assert asked().estimate is None and "not known before its inputs exist" in asked().basis
    pd.DataFrame({"n_prompt_tokens": [10, 300, 20]}).to_parquet(prompts)
    device = asked().device
    work = {"prompts": 2, "batch": 2, "tokens": 300, "layers_run": 6}
    assert asked().estimate == cost.estimate("mlp_activations", OLMO, work, requests.dtype_bytes("auto", device),
                                             device)


def test_a_jobs_margins_are_the_largest_of_its_stages_errors(monkeypatch):
    """A head-scoring job runs attribution and exact patching: the larger of the two stages' errors
    widens it, whichever is larger (here attribution's, made so); a sweep runs exact patching's
    forwards alone, a post-training job the fitted step."""
    table = json.loads(json.dumps(cost.load_coefficients()))
    heads = table["stages"]["heads"]["fit"]
    attribution = table["stages"]["head_attribution"]["fit"]
    attribution |= {"largest_memory_error": heads["largest_memory_error"] + 0.5,
                    "largest_time_factor": heads["largest_time_factor"] + 1}
    monkeypatch.setattr(cost, "load_coefficients", lambda: table)
    assert requests.margins("heads", "olmo") == (attribution["largest_memory_error"], attribution["largest_time_factor"])
    assert requests.margins("sweep", "olmo") == (heads["largest_memory_error"], heads["largest_time_factor"])
    step = table["stages"]["lora_step"]["fit"]
    assert requests.margins("sparsify", "olmo") == (step["largest_memory_error"], step["largest_time_factor"])


def test_mini_batches_hold_whole_prompts():
    """Greater-Than's prompts are 10 rows each (one per first digit): a batch of 15 rows runs 10, a
    batch of 5 still one whole prompt, as ``TaskBatch.whole_prompts`` takes them; never more than
    the prompts there are."""
    pruning = {"tasks": {"greater_than": {"n": 8}}, "rank_share": 0.5, "exact": True, "ranking": "exact",
               "ablation": "corrupted", "sweep_other_ranking": False, "all_k_up_to": 300, "log_points": 40,
               "search": "rounds", "coarse_points": 16}
    assert requests.heads_work(pruning, "greater_than", 15)[0]["batch"] == 10
    assert requests.sweep_work(pruning, "greater_than", 5, 12)["batch"] == 10
    assert requests.sweep_work(pruning, "greater_than", 500, 12)["batch"] == 40  # 4 counted prompts
