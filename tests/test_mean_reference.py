"""Mean ablation's reference as a file (``patching.mean_reference``): what the scoring job writes,
the mean sweep reads back to the bit, and refuses when it was taken for anything else."""

import dataclasses

import pytest
import torch
from safetensors.torch import save_file

from attnlab.patching.mean_reference import Identity, TaskMeans, read_means, write_means

IDENTITY = Identity("ioi", 64, 0, "0123456789abcdef", "base|config 0|weights w:1")


def _means() -> TaskMeans:
    generator = torch.Generator().manual_seed(0)
    # templates as IOI's (ints) and as a string; tokens differ per template, 3 layers of width 8
    by_template = {template: [torch.randn(tokens, 8, generator=generator) for _ in range(3)]
                   for template, tokens in ((0, 5), (7, 6), ("def", 4))}
    return TaskMeans(by_template, pool=61, fewest=2, seed=1000)


def test_the_reference_reads_back_to_the_bit_with_its_templates_and_pool(tmp_path):
    means = _means()
    write_means(means, IDENTITY, tmp_path / "means.safetensors")
    read = read_means(tmp_path / "means.safetensors", IDENTITY, "cpu")
    assert list(read.by_template) == [0, 7, "def"]
    for template, layers in means.by_template.items():
        assert len(read.by_template[template]) == 3
        for got, want in zip(read.by_template[template], layers):
            assert torch.equal(got, want)
    assert (read.pool, read.fewest, read.seed) == (61, 2, 1000)
    assert read.described()["prompts"] == 61 and read.described()["templates"] == 3
    assert [path.name for path in tmp_path.iterdir()] == ["means.safetensors"]  # no temporary left


@pytest.mark.parametrize("asked, differs", [
    (dataclasses.replace(IDENTITY, pool_asked=65), "pool_asked 64 in the file, 65 asked for"),
    (dataclasses.replace(IDENTITY, seed=1), "seed 0 in the file, 1 asked for"),
    (dataclasses.replace(IDENTITY, task="docstring"), "task 'ioi' in the file, 'docstring' asked for"),
    (dataclasses.replace(IDENTITY, held_apart_from="fedcba9876543210"), "held_apart_from '0123456789abcdef' in the file"),
    (dataclasses.replace(IDENTITY, model="copy|config 1|weights w:2"), "model 'base|config 0|weights w:1' in the file"),
])
def test_a_reference_taken_for_another_pool_seed_task_or_prompts_is_refused(tmp_path, asked, differs):
    written = tmp_path / "means.safetensors"
    write_means(_means(), IDENTITY, written)
    with pytest.raises(ValueError, match=rf"{written} was taken for another reference \({differs}.*snakemake -R"):
        read_means(written, asked, "cpu")


def test_a_model_its_copy_and_its_control_have_different_fingerprints(tmp_path):
    """A sparse copy shares its base's tokenizer (the same prompts digest): the fingerprint tells
    their references apart, by folder name, config and weights' sizes, without reading a weight."""
    from attnlab.patching.mean_reference import model_fingerprint

    folders = {}
    for name, config, weights in (("base", "{}", 8), ("copy", '{"attnlab_sparse": {}}', 8), ("control", "{}", 8),
                                  ("again", "{}", 9)):
        folder = folders[name] = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(config)
        (folder / "model.safetensors").write_bytes(bytes(weights))
    prints = {name: model_fingerprint(folder) for name, folder in folders.items()}
    assert len(set(prints.values())) == 4 and prints["base"] == model_fingerprint(folders["base"])
    (tmp_path / "elsewhere").mkdir()
    moved = tmp_path / "elsewhere" / "base"
    folders["base"].rename(moved)
    assert model_fingerprint(moved) == prints["base"]  # the folder's name, not its place
    (moved / "model.safetensors").write_bytes(bytes(9))
    assert model_fingerprint(moved) != prints["base"]


def test_a_file_short_of_tensors_is_refused(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    written = tmp_path / "means.safetensors"
    write_means(_means(), IDENTITY, written)
    tensors = load_file(written)
    with safe_open(str(written), framework="pt") as opened:
        metadata = opened.metadata()
    del tensors["2/2"]
    save_file(tensors, str(written), metadata=metadata)
    with pytest.raises(ValueError, match=r"holds 8 tensors where its 3 templates x 3 layers need 9: it is damaged"):
        read_means(written, IDENTITY, "cpu")


def test_a_file_of_another_format_is_refused_naming_it(tmp_path):
    written = tmp_path / "means.safetensors"
    save_file({"0/0": torch.zeros(1)}, str(written), metadata={"format": "something else"})
    with pytest.raises(ValueError, match=rf"{written}: not a mean-ablation reference of this version.*snakemake -R"):
        read_means(written, IDENTITY, "cpu")


def _jobs(output: str) -> list[dict]:
    """The dry run's jobs: rule, input and output paths."""
    jobs = []
    for block in output.split("\nrule ")[1:]:
        fields = dict(line.strip().split(": ", 1) for line in block.splitlines()[1:] if ": " in line)
        jobs.append({"rule": block.split(":", 1)[0], "input": fields.get("input", "").split(", "),
                     "output": fields.get("output", "").split(", ")})
    return jobs


def test_the_scoring_job_writes_the_reference_and_only_the_mean_sweep_reads_it(tmp_path):
    """make sparse-mean (config/sparse.yaml with config/sparse-mean.yaml: corrupted and mean): each
    scoring job writes mean/means.safetensors, each mean sweep reads its own model's and task's, no
    other job names it; without mean ablation (config/config.yaml) no job does."""
    from conftest import REPO, snakemake

    sparse = snakemake("-n", "--cores", "2", "--configfile", str(REPO / "config/sparse.yaml"),
                       str(REPO / "config/sparse-mean.yaml"), workdir=tmp_path / "s")
    assert sparse.returncode == 0, sparse.stdout
    jobs = _jobs(sparse.stdout)
    for job in jobs:
        named = [path for path in job["input"] + job["output"] if path.endswith("means.safetensors")]
        if job["rule"] == "score_heads":
            folder = job["output"][0].rsplit("/", 1)[0]  # results/pruning/{model}/{task}
            assert job["output"][-1] == f"{folder}/mean/means.safetensors" and named == job["output"][-1:]
        elif job["rule"] == "sweep_heads" and "/mean/" in job["output"][0]:
            folder = job["output"][0].rsplit("/", 2)[0]
            assert named == [f"{folder}/mean/means.safetensors"] and named[0] in job["input"]
        else:
            assert not named, job
    assert sum(job["rule"] == "score_heads" for job in jobs) == 3 * 4  # base, control, copy x four tasks
    assert sum(job["rule"] == "sweep_heads" and "/mean/" in job["output"][0] for job in jobs) == 3 * 4
    plain = snakemake("-n", "--cores", "2", workdir=tmp_path / "d")
    assert plain.returncode == 0 and "score_heads" in plain.stdout and "means.safetensors" not in plain.stdout


@pytest.mark.parametrize("field", [field.name for field in dataclasses.fields(Identity)])
def test_a_reference_written_without_an_identity_field_is_refused_naming_it(tmp_path, field):
    """A file written by an older version, whose identity lacks a field, says nothing of what it
    was taken for on that field: it must not stand in for any model, task, pool, seed or prompts."""
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file

    written = tmp_path / "means.safetensors"
    write_means(_means(), IDENTITY, written)
    tensors = load_file(written)
    with safe_open(str(written), framework="pt") as opened:
        metadata = opened.metadata()
    identity = json.loads(metadata["identity"])
    del identity[field]
    save_file(tensors, str(written), metadata={**metadata, "identity": json.dumps(identity)})
    with pytest.raises(ValueError, match=rf"{written} was taken for another reference \(.*\b{field} None in the file"):
        read_means(written, IDENTITY, "cpu")
