"""Every refusal of the edge code (attnlab.interventions.edges, attnlab.patching.edges), each triggered through
the public API where one reaches it, checked for its exception and message."""

import numpy as np
import pytest
import torch
from torch import nn

from attnlab.interventions import intervened
from attnlab.interventions.edges import EdgePatch, Graph, Plan, ReceiverGradients, Recording
from attnlab.patching.edges import EdgeCircuits
from test_attention import TINY
from test_pruning import _toy_batch

GRAPH = Graph(n_layers=2, n_heads=4, n_kv_heads=2)


def _run(model, ids, patch: EdgePatch):
    with intervened(model, edges=patch):
        return model(input_ids=ids, use_cache=False).logits


# ---- EdgePatch: what goes with what ----


def test_kept_edges_without_the_corrupted_recording_are_refused():
    with pytest.raises(ValueError, match=r"patching edges \(kept=\) needs the corrupted run's Recording "
                                         r"\(corrupted=\)"):
        EdgePatch(GRAPH, kept=GRAPH.valid())


def test_gradients_on_a_patched_pass_are_refused():
    with pytest.raises(ValueError, match=r"receiver gradients \(gradients=\) are taken on unpatched passes: "
                                         "drop kept="):
        EdgePatch(GRAPH, kept=GRAPH.valid(), corrupted=Recording(), gradients=ReceiverGradients())


def test_a_plan_without_its_kept_edges_is_refused():
    with pytest.raises(ValueError, match=r"plan= is the plan of the kept edges: give kept= with it"):
        EdgePatch(GRAPH, plan=Plan.of(GRAPH, GRAPH.valid()))


# ---- Plan ----


def test_a_kept_mask_of_another_shape_is_refused():
    with pytest.raises(ValueError, match=r"kept edges: a \[senders, receivers\] = \(11, 19\) mask, not \(11, 18\)"):
        Plan.of(GRAPH, torch.ones(GRAPH.n_senders, GRAPH.n_receivers - 1, dtype=torch.bool))


def test_an_unknown_base_is_refused():
    with pytest.raises(ValueError, match=r"base: 'live', 'corrupted' or None \(whichever sums fewer\), not 'clean'"):
        Plan.of(GRAPH, GRAPH.valid(), base="clean")


# ---- installing on a model ----


def test_a_patch_made_for_another_graph_is_refused():
    model = TINY["llama-gqa"]()  # 3 layers
    with pytest.raises(ValueError, match=r"the edge patch was made for Graph\(n_layers=2, n_heads=4, n_kv_heads=2, "
                                         r"parallel=False\), the model is Graph\(n_layers=3, n_heads=4, "
                                         r"n_kv_heads=2, parallel=False\)"):
        _run(model, torch.tensor([[3, 4, 5]]), EdgePatch(GRAPH))


def test_a_decoder_layer_without_the_parts_read_is_refused():
    model = TINY["llama-gqa"]()
    del model.model.layers[1].post_attention_layernorm
    with pytest.raises(NotImplementedError, match=r"block 1 \(LlamaDecoderLayer\) has no post_attention_layernorm, "
                                                  r"which the llama family places there"):
        _run(model, torch.tensor([[3, 4, 5]]), EdgePatch(Graph.of(model)))


class _Scale(nn.Module):
    """A norm-like module with neither ``eps`` nor ``variance_epsilon``."""

    def __init__(self, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x):
        return x * self.weight


@pytest.mark.parametrize("norm,message", [
    (lambda: _Scale(64), r"_Scale is not a 'rms_one_plus' norm as its family says"),
    (lambda: nn.LayerNorm(64), r"LayerNorm does not compute what its family's norm kind 'rms_one_plus' says"),
])
def test_a_post_norm_that_is_not_its_familys_kind_is_refused(norm, message):
    """Gemma-3's post-attention norm's scale is split between heads when the patch is installed."""
    model = TINY["gemma3-sliding"]()
    model.model.layers[1].post_attention_layernorm = norm()
    with pytest.raises(NotImplementedError, match=message):
        _run(model, torch.tensor([[3, 4, 5]]), EdgePatch(Graph.of(model)))


def test_a_pre_norm_that_is_not_its_familys_kind_is_refused_when_it_is_folded_or_differentiated():
    """A query/key/value head reading a mix of its own (its pre-norm folded into the projection),
    and a receiver gradient taken back through the pre-norm."""
    model = TINY["llama-gqa"]()
    model.model.layers[1].input_layernorm = nn.LayerNorm(64)
    batch = _toy_batch()
    circuits = EdgeCircuits(model, batch, batch_size=6)
    graph = circuits.graph
    kept = graph.valid().clone()
    kept[0, graph.attention_slice(1).start] = False  # embeddings -> L1.H0.q: that query mixes
    with pytest.raises(NotImplementedError, match="LayerNorm does not compute what its family's norm kind 'rms'"):
        circuits.per_prompt(kept)
    with pytest.raises(NotImplementedError, match="LayerNorm does not compute what its family's norm kind 'rms'"):
        circuits.scores(steps=1)


# ---- recordings and gradients of other shapes ----


def test_a_recording_of_another_batch_is_refused():
    model = TINY["llama-gqa"]()
    batch = _toy_batch()
    circuits = EdgeCircuits(model, batch, batch_size=6)
    graph = circuits.graph
    recording = circuits.corrupted[0]  # 6 prompts of 7 tokens
    kept = graph.valid() & (torch.rand(graph.n_senders, graph.n_receivers,
                                       generator=torch.Generator().manual_seed(0)) < 0.5)
    # fewer rows (the recording's points would index past them), fewer tokens, more rows
    for ids, shape in ((batch.clean[:4], r"\(4, 7\)"), (batch.clean[:, 1:], r"\(6, 6\)"),
                       (torch.cat([batch.clean, batch.clean]), r"\(12, 7\)")):
        with torch.no_grad(), pytest.raises(ValueError, match=rf"edge patching: this pass runs {shape} \[rows, "
                                                              r"tokens\], the corrupted recording \(6, 7\): record "
                                                              "the corrupted run of the same batch of prompts"):
            _run(model, ids, EdgePatch(graph, kept=kept, corrupted=recording))


def test_receiver_gradients_reused_for_another_batch_are_refused():
    model = TINY["llama-gqa"]().requires_grad_(False)
    graph, gradients = Graph.of(model), ReceiverGradients()
    ids = torch.randint(3, 101, (2, 7), generator=torch.Generator().manual_seed(0))
    _run(model, ids, EdgePatch(graph, gradients=gradients))[:, -1, 3].sum().backward()
    logits = _run(model, ids[:, :5], EdgePatch(graph, gradients=gradients))
    with pytest.raises(ValueError, match=r"the receiver gradients were summed over inputs \(14, 64\), this pass "
                                         r"runs \(10, 64\): use one ReceiverGradients per batch of prompts"):
        logits[:, -1, 3].sum().backward()


def test_eap_ig_without_a_step_is_refused():
    circuits = EdgeCircuits(TINY["llama-gqa"](), _toy_batch(), batch_size=6)
    with pytest.raises(ValueError, match="EAP-IG needs at least 1 step, not 0"):
        circuits.scores(steps=0)


def test_gradients_and_differences_at_other_points_are_refused():
    from attnlab.patching.edges import _edge_scores  # private: moved or renamed, only this test breaks

    graph, hidden = Graph(n_layers=1, n_heads=2, n_kv_heads=1), 8
    gradients = ReceiverGradients()
    for receiver in (0, graph.logits_receiver):  # the layer's receivers, and the logits
        group = graph.layer_receivers(receiver)
        gradients.add(group.start, group.stop - group.start, slice(0, 1), torch.zeros(1, 4, hidden))
    differences = torch.zeros(graph.n_senders, 3, hidden)
    with pytest.raises(ValueError, match=r"receiver gradients at \(4, 8\) \[points, hidden\], sender differences "
                                         r"at \(3, 8\): keep both at the same points"):
        _edge_scores(graph, differences, gradients, steps=1)
    assert np.isfinite(_edge_scores(graph, torch.zeros(graph.n_senders, 4, hidden), gradients, 1).numpy()).all()


def test_a_post_norm_that_centres_is_refused(monkeypatch):
    """A family whose attention output passes a LayerNorm (none of today's): its scale cannot be split
    between heads, so the patch is refused when installed (GPT-2's ln_2 made to stand there)."""
    import dataclasses

    from attnlab.anatomy import families

    gpt2 = families.BY_MODEL_TYPE["gpt2"]
    monkeypatch.setitem(families.BY_MODEL_TYPE, "gpt2", dataclasses.replace(
        gpt2, norms={**gpt2.norms, "attention_out": "ln_2"}))
    model = TINY["gpt2"]()
    with pytest.raises(NotImplementedError, match="layer 0's attention output passes a centring norm \\(LayerNorm\\)"):
        _run(model, torch.tensor([[3, 4, 5]]), EdgePatch(Graph.of(model)))
