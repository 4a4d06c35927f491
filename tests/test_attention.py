"""The reduced attention statistics equal those computed from full eager maps."""

import contextlib

import numpy as np
import pandas as pd
import pytest
import torch
from transformers import (AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, GPT2Config, GPTNeoXConfig, LlamaConfig, MistralConfig, Olmo2Config,
                          OlmoConfig, Phi3Config, Qwen2Config, Qwen3Config)

from attnlab import interventions
from attnlab.attention.reduction import BatchReduction
from attnlab.extraction.extract import extract


@contextlib.contextmanager
def _inside(**parts):
    """What ``intervened`` gives the attention function, for calls of ``attend`` without a model."""
    token = interventions._inside.set(interventions.Inside(**parts))
    try:
        yield
    finally:
        interventions._inside.reset(token)


def _prompts(lengths, inserted, vocab, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for i, length in enumerate(lengths):
        start, end = inserted if inserted else (0, 0)
        rows.append({"id": f"p{i}", "input_ids": rng.integers(3, vocab, size=length).tolist(),
                     "n_prompt_tokens": length, "system_start": 0, "system_end": start,
                     "inserted_start": start, "inserted_end": end,
                     "question_start": end, "question_end": length,
                     "cut_start": start, "cut_end": end})
    return pd.DataFrame(rows)


def _reference(model, prompts):
    """received and λ from output_attentions=True, one unpadded prompt at a time."""
    model.set_attn_implementation("eager")
    out = []
    for row in prompts.itertuples():
        ids = torch.tensor([row.input_ids])
        with torch.no_grad():
            maps = model(ids, output_attentions=True).attentions
        per_layer = []
        for a in maps:
            a = a[0].double()  # [H, L, L]
            length = a.shape[-1]
            received = torch.stack([a[:, j + 1:, j].mean(dim=1) if j < length - 1
                                    else torch.full((a.shape[0],), float("nan"), dtype=a.dtype)
                                    for j in range(length)], dim=1)
            lam = 1 - a[:, :, row.inserted_start:row.inserted_end].sum(-1)
            per_layer.append((received.numpy(), lam.numpy(), a.numpy()))
        out.append(per_layer)
    return out


def _tiny(config_class, **extra):
    torch.manual_seed(0)
    config = config_class(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          max_position_embeddings=256, **extra)
    return _random_norms(AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval())


def _tiny_gpt2(**extra):
    """GPT-2 of the same size: one fused c_attn, learned positions, LayerNorms with biases, a plain
    GELU MLP (c_fc, c_proj); its own field names. Weights drawn with std 0.05 rather than GPT-2's
    0.02, so that single heads move the tiny model's metrics by more than 0.01."""
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=101, n_embd=64, n_inner=96, n_layer=3, n_head=4, n_positions=256,
                        bos_token_id=1, eos_token_id=2, initializer_range=0.05, **extra)
    return _random_norms(AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval())


def _tiny_gpt_neox(**extra):
    """GPT-NeoX (Pythia's class) of the same size: parallel attention and MLP, one query_key_value
    with each head's q, k and v side by side, rotary on half of each head, LayerNorms with
    biases, q/k/v and output biases, an untied output embedding."""
    torch.manual_seed(0)
    config = GPTNeoXConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                           num_attention_heads=4, max_position_embeddings=256, rotary_pct=0.5,
                           use_parallel_residual=True, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                           initializer_range=0.05, **extra)
    return _random_norms(AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval())


def _random_norms(model, seed: int = 1):
    """Every norm weight of ``model`` drawn at random: the scale each applies becomes uniform in
    [0.5, 1.5] per unit instead of exactly 1 (Gemma-3's norms scale by 1 + w, w stored 0), and a
    LayerNorm's bias uniform in [-0.5, 0.5] instead of 0, so a norm weight or bias missing,
    applied twice or in the wrong place changes the numbers the tests compare (input_layernorm,
    post_attention_layernorm, pre/post_feedforward_layernorm, GPT-2's ln_1/ln_2/ln_f, the final
    norm, q_norm/k_norm). OLMo-1's norms have no parameters. The other weights stay those of
    ``torch.manual_seed(0)``."""
    generator = torch.Generator().manual_seed(seed)
    norms = [module for module in model.modules()
             if type(module).__name__.endswith("RMSNorm") or type(module).__name__ == "LayerNorm"]
    assert norms or model.config.model_type == "olmo", f"no norm with parameters in {type(model).__name__}"
    with torch.no_grad():
        for norm in norms:
            norm.weight.add_(torch.rand(norm.weight.shape, generator=generator) - 0.5)
            if getattr(norm, "bias", None) is not None:
                norm.bias.add_(torch.rand(norm.bias.shape, generator=generator) - 0.5)
    return model


def _sharper_scores(model, factor: float = 6.0):
    """q_proj and k_proj scaled by ``factor``: the tiny model's attention scores (about 0.1 at
    initialisation) reach a few units, where a soft cap of 2 bends them and heads matter."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(factor)
            layer.self_attn.k_proj.weight.mul_(factor)
    return model


TINY = {
    "llama-gqa": lambda: _tiny(LlamaConfig),
    "qwen2": lambda: _tiny(Qwen2Config),
    "gemma3-sliding": lambda: _tiny(Gemma3TextConfig, sliding_window=5,
                                    layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "gpt2": _tiny_gpt2,
    "olmo": lambda: _tiny(OlmoConfig, pad_token_id=0, eos_token_id=2),  # LayerNorms without parameters
    "olmo2": lambda: _tiny(Olmo2Config, pad_token_id=0, eos_token_id=2),  # post-norms, q/k norms over all heads
    "qwen3": lambda: _tiny(Qwen3Config),  # per-head q/k RMS norms
    "mistral-sliding": lambda: _tiny(MistralConfig, sliding_window=5),  # a window on every layer
    # soft-capped attention (cap 2: the scores here reach it) and final logits, query_pre_attn_scalar,
    # sandwich norms, sliding windows on alternate layers
    "gemma2-softcap": lambda: _sharper_scores(_tiny(Gemma2Config, sliding_window=5, attn_logit_softcapping=2.0,
                                                    final_logit_softcapping=3.0, query_pre_attn_scalar=24,
                                                    layer_types=["sliding_attention", "full_attention",
                                                                 "sliding_attention"])),
    "gpt_neox": _tiny_gpt_neox,
    # fused qkv_proj and gate_up_proj; rotary on half of each head's dimensions
    "phi3": lambda: _tiny(Phi3Config, pad_token_id=0, eos_token_id=2, bos_token_id=1, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                     "partial_rotary_factor": 0.5}),
}


def _check(model, prompts, batch_size, map_layers=()):
    got = extract(model, prompts, batch_size=batch_size, map_layers=list(map_layers))
    want = _reference(model, prompts)
    for p, per_layer in enumerate(want):
        length = prompts["n_prompt_tokens"][p]
        for layer, (received, lam, maps) in enumerate(per_layer):
            np.testing.assert_allclose(got.received[layer][:, p, :length], received, atol=1e-5, rtol=0)
            np.testing.assert_allclose(got.lam[layer][:, p, :length], lam, atol=1e-5, rtol=0)
            assert np.isnan(got.received[layer][:, p, length:]).all()  # padding stays NaN
            if layer in map_layers:
                np.testing.assert_allclose(got.maps[layer][:, p, :length, :length], maps, atol=1e-3)
    return got


@pytest.mark.parametrize("arch", list(TINY))
def test_matches_eager_maps_with_padding(arch):
    model = TINY[arch]()
    # Unequal lengths force left padding inside each batch of 3.
    prompts = _prompts([17, 9, 23, 12], inserted=(3, 8), vocab=101)
    _check(model, prompts, batch_size=3, map_layers=[1])


@pytest.mark.slow
def test_matches_eager_maps_on_smollm2(smollm2_dir, smollm2_tokenizer):
    from attnlab.models import load_model

    model = load_model(smollm2_dir, torch.device("cpu"), torch.float32)
    ids = [smollm2_tokenizer(t).input_ids for t in
           ["You are an expert. / / / / / / What is 2 + 3?", "Hi / / / there, how are you today my friend?"]]
    prompts = pd.DataFrame({"id": ["a", "b"], "input_ids": ids, "n_prompt_tokens": [len(i) for i in ids],
                            "inserted_start": [4, 1], "inserted_end": [10, 4]})
    _check(model, prompts, batch_size=2)


@pytest.mark.parametrize("arch", list(TINY))
def test_many_query_blocks_match_eager_maps(arch, monkeypatch):
    """The smallest block (16 query rows) splits these prompts into up to three blocks."""
    monkeypatch.setitem(interventions.BLOCK_BYTES, "cpu", 1)
    model = TINY[arch]()
    prompts = _prompts([40, 9, 33], inserted=(5, 12), vocab=101)
    _check(model, prompts, batch_size=2, map_layers=[0])


def _gpt_oss():
    """A tiny gpt-oss: its attention adds learned sinks (s_aux), which neither attnlab attention
    implements."""
    from transformers import GptOssConfig

    torch.manual_seed(0)
    config = GptOssConfig(vocab_size=101, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=2,
                          num_experts_per_tok=1, max_position_embeddings=256, sliding_window=8,
                          layer_types=["sliding_attention", "full_attention"])
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def test_a_model_of_an_unknown_family_is_refused_and_attention_sinks_are_never_ignored():
    """gpt-oss is no family the anatomy knows: refused, naming its model_type and the stage; its
    attention sinks would be refused by the attention function itself (called directly)."""
    from torch import nn

    from attnlab.anatomy import UnknownFamily
    from attnlab.attention import sparse

    model = _gpt_oss()
    with pytest.raises(UnknownFamily, match=r"model_type 'gpt_oss'.*\(extraction\)"):
        extract(model, _prompts([12, 9], inserted=(2, 5), vocab=101), 2, [])
    with pytest.raises(UnknownFamily, match=r"model_type 'gpt_oss'.*\(sparse post-training\)"):
        sparse.make_sparse(model, gate_bias=6.0)
    q = k = v = torch.zeros(1, 2, 4, 8)
    module = nn.Module()
    module.layer_idx = 0
    reduce = BatchReduction(torch.ones(1, 4, dtype=torch.bool), torch.zeros(1, 4, dtype=torch.bool))
    with _inside(reduce=reduce), pytest.raises(NotImplementedError, match=r"does not implement \['s_aux'\]"):
        interventions.attend(module, q, k, v, torch.zeros(1, 1, 4, 4), s_aux=torch.zeros(2))


def test_reducing_attention_refuses_what_it_would_get_wrong():
    from torch import nn

    q = k = v = torch.zeros(1, 2, 4, 8)
    mask = torch.zeros(1, 1, 4, 4)
    reduce = BatchReduction(torch.ones(1, 4, dtype=torch.bool), torch.zeros(1, 4, dtype=torch.bool))
    with _inside(reduce=reduce):
        with pytest.raises(RuntimeError, match="needs the model's attention mask"):
            interventions.attend(nn.Module(), q, k, v, None)
        with pytest.raises(RuntimeError, match="needs the whole sequence at once"):
            interventions.attend(nn.Module(), q, torch.zeros(1, 2, 5, 8), torch.zeros(1, 2, 5, 8), mask)
        with pytest.raises(NotImplementedError, match=r"does not implement attention dropout \(0.1\)"):
            interventions.attend(nn.Module(), q, k, v, mask, dropout=0.1)
        with pytest.raises(NotImplementedError, match=r"\['sinks'\]"):
            interventions.attend(nn.Module(), q, k, v, mask, sinks=torch.zeros(2))
    with pytest.raises(RuntimeError, match="on a dense model outside intervened"):
        interventions.attend(nn.Module(), q, k, v, mask)
