"""The prepared model's tokenizer, loaded without torch and, for classes that only rebuild the
backend, as the generic backend from tokenizer.json: the same tokens as the class itself."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from attnlab.tokenization import _backend_stands_in, context_length, load_tokenizer

TEXTS = ["What is 7 + 5?", "  two  spaces\n\nand a blank line", "<bos>specials<eos> inside",
         "ÿ€漢字 🙂 bytes", "\t\tdef f(x):\n    return x  # tabs", "/ / / / he he he", ""]


@pytest.mark.slow
def test_gemma3_loads_as_the_generic_backend_with_the_tokens_of_its_class(gemma3_dir):
    assert _backend_stands_in(gemma3_dir) is not None
    fast, own = load_tokenizer(gemma3_dir), AutoTokenizer.from_pretrained(gemma3_dir)
    assert type(fast).__name__ == "TokenizersBackend" and type(own).__name__ == "GemmaTokenizer"
    for text in TEXTS:
        for special in (True, False):
            ids = own(text, add_special_tokens=special).input_ids
            assert fast(text, add_special_tokens=special).input_ids == ids, text
            assert fast.decode(ids) == own.decode(ids)
    assert fast.all_special_ids == own.all_special_ids and len(fast) == len(own)
    assert (fast.bos_token, fast.eos_token, fast.pad_token) == ("<bos>", "<eos>", "<pad>")
    assert fast.model_input_names == own.model_input_names and fast.padding_side == "left"


def test_a_class_with_methods_of_its_own_is_loaded_as_itself(smollm2_light, tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((smollm2_light / name).read_bytes())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    # CohereTokenizer (Command-R) defines methods beyond its constructor: the file alone may not be it.
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "CohereTokenizer"}))
    assert _backend_stands_in(folder) is None
    assert type(load_tokenizer(folder)).__name__ == "CohereTokenizer"
    # SmolLM2's own class is the generic backend.
    assert type(load_tokenizer(smollm2_light)).__name__ == "TokenizersBackend"


def test_context_length_reads_the_config_and_falls_back_to_its_class(smollm2_light, tmp_path):
    assert context_length(smollm2_light) == 8192
    folder = tmp_path / "model"
    folder.mkdir()
    config = json.loads((smollm2_light / "config.json").read_text())
    del config["max_position_embeddings"]
    (folder / "config.json").write_text(json.dumps(config))
    assert context_length(folder) == 2048  # LlamaConfig's default


def test_a_prompt_job_never_imports_torch(smollm2_light):
    code = ("import sys; from attnlab.tokenization import context_length, load_tokenizer; "
            "from attnlab.steps import make_prompts; from attnlab.reasoning.prompts import make_prompts; "
            f"load_tokenizer({str(smollm2_light)!r}); context_length({str(smollm2_light)!r}); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


def _python_reads_of_tokenizer_json(folder, monkeypatch) -> tuple[object, list[str]]:
    """The tokenizer loaded from ``folder`` and the files transformers parsed with Python's json."""
    reads, original = [], json.load

    def recording(handle, *args, **kwargs):
        reads.append(Path(handle.name).name)
        return original(handle, *args, **kwargs)
    with monkeypatch.context() as patched:
        patched.setattr(json, "load", recording)
        return load_tokenizer(folder), reads


@pytest.mark.parametrize("model", ["smollm2_light", pytest.param("gemma3_dir", marks=pytest.mark.slow)])
def test_a_prepared_tokenizer_loads_in_one_parse_as_the_same_tokenizer(model, request, tmp_path, monkeypatch):
    """prepare_model records the added tokens in tokenizer_config.json (save_tokenizer): the
    tokenizer then loads without transformers' second, Python parse of tokenizer.json, and is
    the same tokenizer as from a folder without the record."""
    prepared = request.getfixturevalue(model)
    assert "added_tokens_decoder" in json.loads((prepared / "tokenizer_config.json").read_text())
    unrecorded = tmp_path / "unrecorded"
    unrecorded.mkdir()
    for file in prepared.iterdir():
        if file.name != "model.safetensors":
            (unrecorded / file.name).write_bytes(file.read_bytes())
    config = json.loads((unrecorded / "tokenizer_config.json").read_text())
    del config["added_tokens_decoder"]
    (unrecorded / "tokenizer_config.json").write_text(json.dumps(config))

    fast, fast_reads = _python_reads_of_tokenizer_json(prepared, monkeypatch)
    slow, slow_reads = _python_reads_of_tokenizer_json(unrecorded, monkeypatch)
    assert "tokenizer.json" not in fast_reads and "tokenizer.json" in slow_reads
    assert fast.backend_tokenizer.to_str() == slow.backend_tokenizer.to_str()
    assert ({i: t.__getstate__() for i, t in fast.added_tokens_decoder.items()}
            == {i: t.__getstate__() for i, t in slow.added_tokens_decoder.items()})
    assert fast.special_tokens_map == slow.special_tokens_map and fast.all_special_ids == slow.all_special_ids
    assert (fast.chat_template, fast.padding_side, type(fast)) == (slow.chat_template, slow.padding_side, type(slow))
    for text in TEXTS:
        assert fast(text).input_ids == slow(text).input_ids, text
