"""benchmarks/sparse/recipes.py's adopt: a copy the workflow made stands for a recipe only when its
recorded settings are that recipe's, and arrives whole (every output, its control) or not at all."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks.sparse import recipes as sparse_recipes

REPO = Path(__file__).resolve().parents[1]


def _made_by_the_workflow(tmp_path, settings: dict) -> SimpleNamespace:
    model, control, results = tmp_path / "model", tmp_path / "control", tmp_path / "results"
    for folder in (model, control, results):
        folder.mkdir()
    (model / "attnlab_source.json").write_text(json.dumps({"source": {"sparsify": settings}}))
    (model / "model.safetensors").write_bytes(b"weights")
    (control / "model.safetensors").write_bytes(b"control weights")
    for name in ("summary.json", "steps.csv", "eval.csv", "density.csv"):
        (results / name).write_text(name)
    return SimpleNamespace(model=str(model), control=str(control), results=str(results))


def test_a_copy_is_adopted_as_the_recipe_its_settings_are(tmp_path, monkeypatch):
    monkeypatch.setattr(sparse_recipes, "OUT", tmp_path / "out")
    made = _made_by_the_workflow(tmp_path, sparse_recipes.filled(sparse_recipes.recipes()["ce-control"]))
    sparse_recipes.adopt(SimpleNamespace(recipes=["ce-control"], **vars(made)))
    folder = tmp_path / "out" / "ce-control"
    assert (folder / "model" / "model.safetensors").read_bytes() == b"weights"
    assert (folder / "control" / "model.safetensors").read_bytes() == b"control weights"
    assert (folder / "summary.json").read_text() == "summary.json"
    assert json.loads((folder / "settings.json").read_text()) == sparse_recipes.filled(
        sparse_recipes.recipes()["ce-control"])
    with pytest.raises(SystemExit, match="exists"):  # never over a recipe already there
        sparse_recipes.adopt(SimpleNamespace(recipes=["ce-control"], **vars(made)))


def test_a_copy_of_other_settings_is_refused_naming_each_difference(tmp_path, monkeypatch):
    monkeypatch.setattr(sparse_recipes, "OUT", tmp_path / "out")
    made = _made_by_the_workflow(tmp_path, sparse_recipes.filled(sparse_recipes.recipes()["ce-control"]))
    with pytest.raises(SystemExit, match=r"constraint: \{'type': 'ce_control'.*\} there, \{'type': 'ce',.*\} here"):
        sparse_recipes.adopt(SimpleNamespace(recipes=["ce"], **vars(made)))
    assert not (tmp_path / "out" / "ce").exists()
