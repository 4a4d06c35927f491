"""A prepared model folder against the GGUF it was converted from."""

import pytest
import torch
from safetensors import safe_open

from attnlab.models import load_model
from conftest import SMOLLM2

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("model_name", ["smollm2", "gemma3"])
def test_tied_embeddings_are_stored_once(model_name, request):
    """Both embedded models tie their output embedding to the input one: the rebuilt model (its
    weights left uninitialised, then loaded) must tie them too, or the folder stores the
    vocabulary twice (SmolLM2: 651 MB instead of 538) and a reload unties what the GGUF tied."""
    folder = request.getfixturevalue(f"{model_name}_dir")
    with safe_open(folder / "model.safetensors", "pt") as stored:
        keys = set(stored.keys())
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys
    model = load_model(folder, torch.device("cpu"), torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_the_prepared_model_computes_what_the_gguf_does(smollm2_dir, tmp_path):
    """The same logits, to the last bit, as transformers' own GGUF loading (dequantized to
    float32) on a prompt: no weight, buffer or tie lost in the conversion."""
    from transformers import AutoModelForCausalLM

    from attnlab import models

    folder, name = models._gguf_location(SMOLLM2, tmp_path)
    with models._gguf_parsed_once():
        gguf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    prepared = load_model(smollm2_dir, torch.device("cpu"), torch.float32)
    ids = torch.tensor([[1, 504, 3154, 282, 216, 34, 1232, 216, 37, 47, 2]])
    with torch.inference_mode():
        assert torch.equal(prepared(input_ids=ids).logits, gguf(input_ids=ids).logits)


def test_the_light_folder_holds_the_prepared_folders_tokenizer_and_config(smollm2_dir, smollm2_light):
    """The fixture that spares the fast tests a conversion (tests/conftest.py, smollm2_light) must
    hold what prepare_model writes: the same tokenizer files, byte for byte, and the same model
    config apart from what only a saved model records (its dtype and class)."""
    import json

    tokenizer_files = [path.name for path in smollm2_light.iterdir() if path.name != "config.json"]
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(tokenizer_files)
    for name in tokenizer_files:
        assert (smollm2_light / name).read_bytes() == (smollm2_dir / name).read_bytes(), name
    light, prepared = (json.loads((folder / "config.json").read_text()) for folder in (smollm2_light, smollm2_dir))
    recorded_on_save = {"architectures", "dtype", "torch_dtype", "transformers_version"}
    assert {key: value for key, value in light.items() if key not in recorded_on_save} == \
        {key: value for key, value in prepared.items() if key not in recorded_on_save}
