"""Bad input refused before the first job, and damaged model folders named with their fix. One
case of each kind runs the Snakemake CLI as a user would (a dry run, where the refusal must come
before any job) and checks the message and that nothing was written under results/; the other
cases of a kind are found in process (conftest.refusal: the check the dry run makes)."""

import time

import pytest
import yaml

from conftest import REPO, dry_run, fake_prepared_model, job_counts, refusal, snakemake

MODEL = "smollm2-135m"


def _tiny():
    return yaml.safe_load((REPO / "tests/configs/tiny.yaml").read_text())


def _refused(tmp_path, config, *needles):
    result = dry_run(tmp_path, config)
    assert result.returncode != 0, result.stdout[-2000:]
    for needle in needles:
        assert needle in result.stdout, (needle, result.stdout[-3000:])
    assert not (tmp_path / "results").exists() or not any((tmp_path / "results").rglob("*")), \
        "a refused config wrote results"
    return result.stdout


def _local_dataset(tmp_path, content: bytes, name="mine.jsonl"):
    path = tmp_path / name
    path.write_bytes(content)
    config = _tiny()
    config["datasets"] = {"mine": {"source": {"path": str(path)}, "question": ["question"],
                                   "answer": "answer", "id": "id", "answer_format": "number"}}
    config["attention"]["datasets"] = ["mine"]
    return config


def test_a_dataset_file_that_does_not_exist_is_refused_before_any_job(tmp_path):
    config = _local_dataset(tmp_path, b"")
    config["datasets"]["mine"]["source"]["path"] = str(tmp_path / "nope.jsonl")
    message = refusal(config, tmp_path)
    for needle in ("datasets.mine.source.path", str(tmp_path / "nope.jsonl"), "does not exist"):
        assert needle in message, (needle, message)


def test_a_bad_local_dataset_is_refused_by_a_dry_run_before_any_job(tmp_path):
    """The job's own reader of the file, called while Snakemake parses: the first bad row named."""
    content = b'{"id": "a", "question": "1+1?", "answer": "2"}\n{"id": "b", "answer": "3"}\n'
    _refused(tmp_path, _local_dataset(tmp_path, content), "mine.jsonl",
             "question field(s) ['question']: no text at row 2 (id 'b')")


@pytest.mark.parametrize("content,message", [
    (b'{"id": "a", "question": "1+1?", "answer": "2"}\n{"id": "b", "question": \n', "line 2 is not valid JSON"),
    (b'{"id": "a", "question": "1+1?", "answer": "2"}\n{"id": "b", "answer": "3"}\n',
     "question field(s) ['question']: no text at row 2 (id 'b')"),
    (b'{"id": "a", "question": "1+1?", "answer": "2"}\n{"id": "b", "question": "2+1?"}\n',
     "field 'answer': no value at row 2"),
    (b"", "the file is empty"),
    (b'{"id": "a", "question": "1+1?", "answer": "2"}\n{"id": "b", "question": "caf\xe9?", "answer": "3"}\n',
     "line 2 has a byte that is not UTF-8"),
    (b'{"id": "a", "question": "1+1?", "answer": "2"}\n{"id": "b", "question": "2+1?", "answer": "3"}\n'
     b'{"id": "a", "question": "2+2?", "answer": "4"}\n', "is not unique: 'a' at rows 1, 3"),
])
def test_a_bad_local_dataset_is_refused_before_any_job_naming_file_and_row(tmp_path, content, message):
    found = refusal(_local_dataset(tmp_path, content), tmp_path)
    assert message in found and str(tmp_path / "mine.jsonl") in found, found


def test_a_key_given_twice_is_refused_naming_it_and_both_lines(tmp_path):
    text = (REPO / "tests/configs/tiny.yaml").read_text()
    text = text.replace("conditions:\n", "conditions:\n  mless: {kind: repeat, unit: \"/\", length: 5}\n", 1)
    (tmp_path / "config.yaml").write_text(text)
    result = snakemake("-n", "--cores", "1", "--configfile", str(tmp_path / "config.yaml"), workdir=tmp_path)
    assert result.returncode != 0
    assert "key 'mless' is given twice in one mapping (lines 23 and 25)" in result.stdout, result.stdout[-2000:]
    assert str(tmp_path / "config.yaml") in result.stdout


def test_a_head_outside_the_model_is_refused_before_it_is_prepared(tmp_path):
    """The layer count comes from the GGUF header of the model's package: no job is needed."""
    config = _tiny()
    config["attention"]["heads"] = [{"layer": 99, "head": 0}]
    _refused(tmp_path, config, "has 30 layers x 9 heads", "'layer': 99", "is out of range",
             "read from its source's metadata")


def _prepared(tmp_path):
    return fake_prepared_model(tmp_path / f"resources/models/{MODEL}")


def test_a_damaged_config_json_names_the_file_and_the_rebuild_that_works(tmp_path):
    folder = _prepared(tmp_path)
    assert dry_run(tmp_path, _tiny()).returncode == 0  # whole
    text = (folder / "config.json").read_text()
    (folder / "config.json").write_text(text[:len(text) // 2])
    _refused(tmp_path, _tiny(), f"{folder.relative_to(tmp_path)}/config.json: not JSON",
             f"snakemake -R resources/models/{MODEL}")
    result = snakemake("-n", "--cores", "1", "--configfile", str(tmp_path / "config.yaml"),
                       "-R", f"resources/models/{MODEL}", workdir=tmp_path)
    assert result.returncode == 0, result.stdout[-2000:]
    assert job_counts(result.stdout)["prepare_model"] == 1


def test_cut_weights_name_the_file_and_the_rebuild(tmp_path):
    folder = _prepared(tmp_path)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-6])
    message = refusal(_tiny(), tmp_path)
    for needle in (f"{weights.relative_to(tmp_path)}: ", "where its header describes",
                   f"snakemake -R resources/models/{MODEL}"):
        assert needle in message, (needle, message)


def test_the_default_dry_run_validates_in_under_5_seconds(tmp_path):
    started = time.perf_counter()
    result = snakemake("-n", "--cores", "1", workdir=tmp_path)
    elapsed = time.perf_counter() - started
    assert result.returncode == 0, result.stdout[-2000:]
    assert elapsed < 5, f"the default config's dry run took {elapsed:.1f} s"


def test_rebuild_requests_are_read_from_the_command_line_while_parsing():
    from attnlab.config.validate import rebuild_requests

    argv = ["snakemake", "-n", "-R", "resources/models/a", "prepare_model", "--cores", "1"]
    assert rebuild_requests(argv) == {"resources/models/a", "prepare_model"}
    assert rebuild_requests(["snakemake", "--forceall"]) == {"all"}
    assert rebuild_requests(["snakemake", "--forcerun=a b"]) == {"a", "b"}
    assert rebuild_requests(["snakemake", "--cores", "2", "results/x.png"]) == set()


def test_edge_circuits_of_a_task_without_a_head_sweep_are_refused_before_any_job(tmp_path):
    config = _tiny()
    config["pruning"]["edges"] = {"tasks": ["docstring"]}
    message = refusal(config, tmp_path)
    assert "pruning.edges.tasks names ['docstring'], which pruning.tasks lacks" in message
    assert "add the task to pruning.tasks" in message


def test_edge_circuits_plan_one_job_per_model_and_task(tmp_path):
    config = _tiny()
    config["pruning"]["edges"] = {"tasks": ["ioi"]}
    result = dry_run(tmp_path, config)
    assert result.returncode == 0, result.stdout[-3000:]
    counts = job_counts(result.stdout)
    assert counts["edge_circuit"] == counts["sweep_heads"] and counts["plot_edges"] == 1
