"""The papers' model families through the stages not covered family by family elsewhere: sparse
post-training (a gated training step against the float64 hand forward's autograd; the trainer's
dropout, parameters and LoRA targets through each family's own names) and generation (every
engine's tokens against transformers' ``generate``, one prompt at a time).

Covered elsewhere for every family of ``test_attention.TINY``: extraction (test_attention), the
kernels (test_kernels), head patching (test_exact_patching, test_pruning), edge circuits
(test_edges_references), MLP recording and ARM (test_mlp)."""

import logging

import pandas as pd
import pytest
import torch

from attnlab import interventions, sparsify
from attnlab.attention import sparse
from attnlab.interventions import intervened
from attnlab.reasoning.generation import generate_all
from attnlab.sparsify.errors import SparsifyError
from attnlab.sparsify.train import lora_targets, trainable_parameters
from hand_forward import HandForward
from test_attention import TINY
from test_decoding import EOS, _prompts, _Tokenizer



@pytest.mark.parametrize("arch", list(TINY))
def test_a_gated_training_step_equals_autograd_of_the_hand_forward(arch, monkeypatch):
    """Cross-entropy plus the expected density of a sparse copy in training, its gates drawn with
    the logistic noise at 0 (uniform draws of 0.5): the loss and every weight's gradient equal
    those of the float64 hand forward's straight-through gate (hand_forward.py)."""
    monkeypatch.setattr(torch, "rand", lambda shape, generator=None, device=None, dtype=None:
                        torch.full(tuple(shape), 0.5, device=device, dtype=dtype))
    ids = torch.randint(3, 101, (2, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    positions = torch.arange(ids.shape[1]).expand_as(ids)

    def loss_and_gradients(run):
        model = TINY[arch]().double()
        sparse.make_sparse(model, 0.0)
        logits, density = run(model)
        ce = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        (ce + density).backward()
        return ce.detach(), density.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    def library(model):
        tracker = sparse.GateTracker(training=True, generator=torch.Generator().manual_seed(0))
        with intervened(model, gates=tracker):
            logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
        return logits, tracker.expected_density()

    def by_hand(model):
        hand = HandForward(model, gate_bias=0.0, training=True)
        embeds = model.get_input_embeddings()(ids)
        return hand.forward(embeds, mask, positions)[0], hand.expected_density()

    ce, density, grads = loss_and_gradients(library)
    want_ce, want_density, want_grads = loss_and_gradients(by_hand)
    assert 0.2 < float(density) < 0.8  # the gates are neither all open nor all shut
    assert float(ce) == pytest.approx(float(want_ce), rel=1e-6)
    # the library's float32 gates: a mean of ~1e3 sigmoids rounds to ~log2(1e3) eps32 ~1e-6 (seen 1e-7)
    assert float(density) == pytest.approx(float(want_density), rel=1e-5)
    assert grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():  # the library's gates are float32 (sparse.stochastic_gate)
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-5 * float(grad.abs().max()),
                                   msg=lambda text, name=name: f"{name}: {text}")


DROPOUT_FIELDS = {"gpt2": ("attn_pdrop", "resid_pdrop", "embd_pdrop"),
                  "phi3": ("attention_dropout", "resid_pdrop", "embd_pdrop"),
                  "gpt_neox": ("attention_dropout", "hidden_dropout")}


@pytest.mark.parametrize("arch", list(DROPOUT_FIELDS))
def test_training_turns_dropout_off_through_the_familys_own_fields(arch, tmp_path, caplog):
    """Each family's own dropout fields at 0.1, saved as a prepared model: the trainer's copy has
    them at 0 (logged by name) and no dropout module left on."""
    from attnlab.sparsify.train import _trainable_copy

    model = TINY[arch]()
    for field in DROPOUT_FIELDS[arch]:
        setattr(model.config, field, 0.1)
    model.save_pretrained(tmp_path / arch)
    with caplog.at_level(logging.INFO, logger="attnlab.sparsify.train"):
        model = _trainable_copy(str(tmp_path / arch), torch.float32, torch.device("cpu")).train()
    assert ", ".join(f"{field} 0.1 -> 0" for field in DROPOUT_FIELDS[arch]) in caplog.text
    dropouts = [module.p for module in model.modules() if isinstance(module, torch.nn.Dropout)]
    assert dropouts and set(dropouts) == {0.0}
    sparse.make_sparse(model, 0.0)
    tracker = sparse.GateTracker(training=True, generator=torch.Generator().manual_seed(0))
    with intervened(model, gates=tracker):  # in training mode: the gated attention is handed no dropout
        model(input_ids=torch.tensor([[3, 4, 5, 6]])).logits.sum().backward()


def test_trained_parameters_and_lora_targets_are_the_familys_attention_projections():
    gpt2, llama = TINY["gpt2"](), TINY["llama-gqa"]()
    attention = trainable_parameters(gpt2, "attention")
    assert attention and all(".attn.c_attn." in name or ".attn.c_proj." in name for name in attention)
    assert len(attention) == 3 * 4  # c_attn and c_proj, weight and bias, in 3 blocks
    with pytest.raises(SparsifyError, match="share one projection \\(c_attn\\): set train to attention, all or lora"):
        trainable_parameters(gpt2, "qk")
    qk = trainable_parameters(llama, "qk")
    assert len(qk) == 2 * 3 and all(".q_proj." in name or ".k_proj." in name for name in qk)
    assert lora_targets(gpt2, ["q", "k", "v", "o"]) == ["attn.c_attn", "attn.c_proj"]
    assert lora_targets(llama, ["q", "k", "v", "o", "up_proj"]) == [
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "up_proj"]
    assert sparsify.train.with_lora(gpt2, sparsify.settings.Lora(rank=2, alpha=4, modules=("q", "o"))) is not None
    assert lora_targets(TINY["phi3"](), ["q", "k", "v", "o"]) == ["self_attn.qkv_proj", "self_attn.o_proj"]
    assert lora_targets(TINY["gpt_neox"](), ["q", "k", "v", "o"]) == ["attention.query_key_value", "attention.dense"]


def _generate_alone(model, prompts: pd.DataFrame, max_new_tokens: int) -> list[list[int]]:
    """Each prompt's greedy tokens from transformers' generate, alone (no padding), cut after EOS: a
    pad token (0 here) the model emits before it is a token like any other (issue 67)."""
    out = []
    for ids in prompts["input_ids"]:
        with torch.no_grad():
            tokens = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=EOS,
                                    pad_token_id=0)[0, len(ids):].tolist()
        out.append(tokens[:tokens.index(EOS) + 1] if EOS in tokens else tokens)
    return out


@pytest.mark.parametrize("arch", list(TINY))
@pytest.mark.parametrize("engine", ["static", "static_cache"])
def test_each_engine_gives_generates_tokens(arch, engine):
    """Left-padded batches of 4 (the static engine's shared prefix included) against one prompt at a
    time; ``static_cache`` is the CUDA engine's loop, run here on the CPU without its graphs
    (Gemma-3's window of 5 binds: prompts of up to 12 tokens, 12 new)."""
    model = TINY[arch]()
    if arch != "gemma2-softcap":  # Gemma-2 has eager attention alone (it soft-caps the scores)
        model.set_attn_implementation("sdpa")
    model.generation_config.eos_token_id = EOS
    prompts = _prompts()
    got = generate_all(model, _Tokenizer(), prompts, 4, 12, engine=engine)
    assert set(got["engine"]) == {engine}
    assert [list(tokens) for tokens in got["new_token_ids"]] == _generate_alone(model, prompts, 12)


def test_a_sparse_gpt2_generates_with_its_gates_as_a_full_forward_does():
    model = TINY["gpt2"]()
    sparse.make_sparse(model, 0.0)
    ids = torch.randint(3, 101, (1, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        generated = model.generate(ids, max_new_tokens=4, do_sample=False)
        full = model(generated).logits[0, 7:-1].argmax(-1)
    assert torch.equal(generated[0, 8:], full)
    assert interventions.IMPLEMENTATION == model.config._attn_implementation
