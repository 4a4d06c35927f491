"""Edge circuits against a forward written in float64 from the tiny models' weights
(``hand_forward.HandForward``: every receiver reads its own input; Llama, Qwen2, Gemma-3, GPT-2,
OLMo and OLMo-2, each with its own norms and their places).

Checked against it, per family: a partial circuit's metrics (and sparse copies'), EAP scores
against finite differences of it, and the whole EAP-IG score matrix at 5 steps against an einsum
of its sender differences and its receivers' autograd gradients.
"""

import numpy as np
import pytest
import torch

from attnlab.attention import sparse
from attnlab.interventions import intervened
from attnlab.interventions.edges import Graph
from attnlab.patching.edges import EdgeCircuits, recording_bytes
from attnlab.patching.heads import TaskBatch
from hand_forward import HandForward
from test_attention import TINY, _tiny
from test_pruning import _toy_batch


def _metric(logits, prompts):  # float64 throughout
    return logits[:, -1, 3] - logits[:, -1, 5]


def _batch(padding: bool = True) -> TaskBatch:
    """Six prompts of seven tokens, row i's corrupted prompt sharing its first i tokens with the
    clean one (patched passes start at each first difference); with ``padding`` rows 1 and 3 are
    left-padded (2 and 1 tokens)."""
    batch = _toy_batch()
    clean, corrupted, mask = batch.clean.clone(), batch.corrupted.clone(), batch.mask.clone()
    for row in range(len(clean)):
        corrupted[row, :row] = clean[row, :row]
    if padding:
        for row, pad in ((1, 2), (3, 1)):
            clean[row, :pad] = corrupted[row, :pad] = 0
            mask[row, :pad] = 0
    return TaskBatch(clean, corrupted, mask, batch.templates, _metric, read_positions=1)


def _model(arch: str, gate_bias: float | None = None):
    model = _olmo_clipped() if arch == "olmo-clip_qkv" else TINY[arch]()
    if gate_bias is not None:
        sparse.make_sparse(model, gate_bias)
    return model.to(torch.float64).requires_grad_(False)


def _pads(arch: str) -> bool:
    """Whether the float64 comparisons may left-pad: not Gemma-2, whose own eager attention (its
    only one: soft-capping) softmaxes in float32, where float64's mask minimum is -inf and a
    padding row NaN that reaches real tokens (in float32 and bfloat16 models it stays finite)."""
    return arch != "gemma2-softcap"


def _olmo_clipped():
    """OLMo with its q, k and v clamped (OLMo-7B-0424 and later: clip_qkv 8): at ±0.15 here, about
    a third of the tiny model's query values are clamped (the model clamps its projections' outputs
    in place, here the stand-ins' own, per head)."""
    from transformers import OlmoConfig

    return _tiny(OlmoConfig, pad_token_id=0, eos_token_id=2, clip_qkv=0.15)


def _model_metric(model, batch: TaskBatch, ids: torch.Tensor) -> np.ndarray:
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=batch.mask, position_ids=batch.positions).logits
    return batch.metric(logits, slice(0, batch.n_prompts)).numpy()


def _check_hand_forward(model, hand: HandForward, batch: TaskBatch) -> None:
    """The hand forward with every edge kept is the model's own forward, clean and corrupted (the
    model's norms round to float32 even in a float64 model)."""
    with torch.no_grad():
        for ids in (batch.clean, batch.corrupted):
            np.testing.assert_allclose(hand.run(batch, ids)[0].numpy(), _model_metric(model, batch, ids),
                                       atol=1e-5, rtol=0)


def _partial_mask(graph: Graph, seed: int) -> torch.Tensor:
    """About a third of the edges kept; the logits keep every sender but the embeddings, so that
    every head's and MLP's output reaches the metric (and with it every receiver's input); one
    receiver per kind keeps all of its edges, one none."""
    valid = graph.valid()
    kept = valid & (torch.rand(valid.shape, generator=torch.Generator().manual_seed(seed)) < 0.3)
    kept[:, graph.logits_receiver] = True
    kept[0, graph.logits_receiver] = False
    first = graph.attention_slice(1).start
    for everything in (first, first + graph.n_heads, graph.mlp_receiver(0)):  # a query, a key, an MLP
        kept[:, everything] = valid[:, everything]
    for nothing in (first + 1, first + graph.n_heads + graph.n_kv_heads, graph.mlp_receiver(2)):  # q, v, MLP
        kept[:, nothing] = False
    return kept


# gate biases that close about 40-50% of these models' edges (the tiny Llama's attention logits stay
# within about ±0.1: a bias of 0.5 closes none of them)
@pytest.mark.parametrize("arch,gate_bias", [("gemma3-sliding", None), ("llama-gqa", 0.01),
                                            ("gemma3-sliding", 0.05), ("qwen2", None), ("gpt2", None), ("olmo", None),
                                            ("olmo2", None), ("gpt2", 0.0), ("olmo-clip_qkv", None)])
def test_a_partial_circuit_equals_each_receivers_input_summed_by_hand(arch, gate_bias):
    """A random third of the edges kept: each receiver's input summed here from the live and the
    corrupted per-sender activations (Gemma-3's heads scaled by the post-norm of their block's
    whole output; a sparse copy's heads gated, not renormalised), its own pre-norm applied."""
    model = _model(arch, gate_bias)
    # a float64 sparse copy's attention turns a padded query's row into NaN (its float64 mask,
    # cast to float32 for the softmax, becomes -inf), which reaches every token: no padding there
    batch = _batch(padding=gate_bias is None)
    hand = HandForward(model, gate_bias)
    _check_hand_forward(model, hand, batch)
    if gate_bias is not None:  # the gates close edges here: gated attention is not plain attention
        tracker = sparse.GateTracker()
        with torch.no_grad(), intervened(model, gates=tracker):
            model(input_ids=batch.clean)
        assert 0.2 < tracker.inference_density() < 0.8
    circuits = EdgeCircuits(model, batch, batch_size=6)
    kept = _partial_mask(circuits.graph, seed=0)
    with torch.no_grad():
        clean, _ = hand.run(batch, batch.clean)
        corrupted_metric, corrupted = hand.run(batch, batch.corrupted)
        want, _ = hand.run(batch, batch.clean, kept=kept, corrupted=corrupted)
    got = circuits.per_prompt(kept)[1]
    np.testing.assert_allclose(got, want.numpy(), atol=1e-6 * max(1.0, float(want.abs().max())), rtol=0)
    for end in (clean, corrupted_metric):  # a circuit between the two ends: the comparison can fail
        assert (want - end).abs().max() > 1e-2


@pytest.mark.parametrize("arch", [*TINY, "olmo-clip_qkv"])
def test_one_step_scores_equal_finite_differences_of_the_hand_forward(arch):
    """EAP (1 step): score(s → r) is d mean-metric / dt with r's input alone shifted by t (clean −
    corrupted activation of s), at the clean input. For the largest edge into a layer's query,
    key and value heads, into its MLP from its own heads (on Gemma-3 through the post-attention
    norm's scale) and into the logits, a central difference of the hand forward (float64: no
    float32 rounding in its norms, so a small step)."""
    model = _model(arch)
    batch = _batch(padding=_pads(arch))
    hand = HandForward(model)
    _check_hand_forward(model, hand, batch)
    circuits = EdgeCircuits(model, batch, batch_size=6)
    graph = circuits.graph
    scores = circuits.scores(steps=1).double()
    with torch.no_grad():
        _, clean = hand.run(batch, batch.clean)
        _, corrupted = hand.run(batch, batch.corrupted)
    first = graph.attention_slice(1).start
    h, g = graph.n_heads, graph.n_kv_heads
    receivers = {"query": range(first, first + h), "key": range(first + h, first + h + g),
                 "value": range(first + h + g, first + h + 2 * g), "logits": [graph.logits_receiver]}
    edges = []
    for receivers_of_kind in receivers.values():
        block = scores[:, list(receivers_of_kind)].abs()
        sender, column = divmod(int(block.argmax()), block.shape[1])
        edges.append((sender, list(receivers_of_kind)[column]))
    mlp = graph.mlp_receiver(1)
    # this layer's heads into its MLP (a parallel block's MLP reads the block's input: layer 0's)
    heads = [graph.head_sender(0 if graph.parallel else 1, head) for head in range(h)]
    edges.append((heads[int(scores[heads, mlp].abs().argmax())], mlp))
    step = 1e-4  # float64 throughout: the central difference's error is O(step²)
    for sender, receiver in edges:
        difference = clean[sender] - corrupted[sender]

        def shifted(t):
            with torch.no_grad():
                return float(hand.run(batch, batch.clean, shifts={receiver: t * difference})[0].mean())
        estimate = (shifted(step) - shifted(-step)) / (2 * step)
        assert abs(estimate) > 1e-4, (sender, receiver)  # an edge that matters
        assert scores[sender, receiver].item() == pytest.approx(estimate, rel=1e-4), (sender, receiver)


def _eap_ig_by_hand(hand: HandForward, batch: TaskBatch, steps: int) -> torch.Tensor:
    """[senders, receivers]: Σ over prompts, tokens and hidden units of (clean − corrupted) sender
    activations (the hand forward's) times the mean over k = 1..steps of the gradient of the mean
    metric at each receiver's own input (autograd through a zero shift of each receiver's input
    in the hand forward), at input embeddings corrupted + (k / steps)(clean − corrupted)."""
    graph = hand.graph
    embed = hand.model.get_input_embeddings()
    with torch.no_grad():
        clean_in, corrupted_in = embed(batch.clean).double(), embed(batch.corrupted).double()
        _, clean = hand.run(batch, embeds=clean_in)
        _, corrupted = hand.run(batch, embeds=corrupted_in)
    differences = torch.stack(clean) - torch.stack(corrupted)  # [senders, rows, tokens, hidden]
    gradients = torch.zeros(graph.n_receivers, *clean_in.shape, dtype=torch.float64)
    for k in range(1, steps + 1):
        shifts = torch.zeros_like(gradients, requires_grad=True)
        metric, _ = hand.run(batch, embeds=corrupted_in + (k / steps) * (clean_in - corrupted_in), shifts=shifts)
        (metric.sum() / batch.n_prompts).backward()
        gradients += shifts.grad
    scores = torch.einsum("sbtd,rbtd->sr", differences, gradients / steps)
    return scores * graph.valid()


@pytest.mark.parametrize("arch", [*TINY, "olmo-clip_qkv"])
def test_eap_ig_at_five_steps_equals_an_einsum_of_hand_differences_and_gradients(arch):
    """The whole score matrix (every sender against every query, key/value, MLP and logits
    receiver) at the default 5 steps: the interpolation, the sum over steps, the division and
    the columns assembled by slicing."""
    model = _model(arch)
    batch = _batch(padding=_pads(arch))
    hand = HandForward(model)
    circuits = EdgeCircuits(model, batch, batch_size=4)  # two mini-batches
    got = circuits.scores(steps=5).double()
    want = _eap_ig_by_hand(hand, batch, steps=5)
    scale = float(want.abs().max())
    assert scale > 1e-2
    valid = circuits.graph.valid()
    assert (want[valid].abs() > 1e-6 * scale).float().mean() > 0.9  # nearly every edge scored
    assert torch.equal(got[~valid], torch.zeros_like(got[~valid]))
    # the library scores in float32 from a model whose norms round to float32
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * scale)
    # one step is not five: the comparison sees the interpolation
    one = _eap_ig_by_hand(hand, batch, steps=1)
    assert (one - want).abs().max() > 1e-2 * scale


@pytest.mark.parametrize("arch", [*TINY, "olmo-clip_qkv"])
def test_scores_taken_in_chunks_of_points_equal_the_whole_batch_and_the_hand_einsum(arch):
    """``score_chunk`` bounds a pass's points (its receivers' gradients and senders' activations):
    one point at a time, three, and more than a batch holds give the unchunked matrix to float32
    rounding (the library returns float32 scores), and one point at a time the hand forward's."""
    model = _model(arch)
    batch = _batch(padding=_pads(arch))
    whole = EdgeCircuits(model, batch, batch_size=4).scores(steps=2).double()
    scale = float(whole.abs().max())
    assert scale > 1e-2
    for chunk in (1, 3, 10_000):
        chunked = EdgeCircuits(model, batch, batch_size=4, score_chunk=chunk).scores(steps=2).double()
        torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-7 * scale)
        if chunk == 1:
            torch.testing.assert_close(chunked, _eap_ig_by_hand(HandForward(model), batch, steps=2),
                                       rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.parametrize("arch", ["llama-gqa", "gpt2", "gemma3-sliding"])
def test_circuits_with_the_corrupted_recordings_recorded_again_equal_those_kept(arch):
    """``cache_bytes`` keeps the corrupted recordings that fit it (none; the first of two
    mini-batches) and records the others again at each evaluation: the same metrics, circuit by
    circuit, as all of them kept."""
    model = _model(arch)
    batch = _batch(padding=_pads(arch))
    kept_all = EdgeCircuits(model, batch, batch_size=4)
    masks = [_partial_mask(kept_all.graph, seed) for seed in range(2)]
    want = [kept_all.per_prompt(kept)[1] for kept in masks]
    one = recording_bytes(kept_all.corrupted_run(0))
    for budget, kept_count in ((0, 0), (one, 1)):
        circuits = EdgeCircuits(model, batch, batch_size=4, cache_bytes=budget)
        assert circuits.recordings_kept == (kept_count, 2)
        assert circuits.corrupted_metric() == kept_all.corrupted_metric()
        for kept, expected in zip(masks, want):
            np.testing.assert_allclose(circuits.per_prompt(kept)[1], expected, rtol=0, atol=1e-12)
    assert kept_all.recordings_kept == (2, 2)
    # one mini-batch of six: the shared table viewed at other shapes gives the same metrics
    whole = EdgeCircuits(model, batch, batch_size=6)
    for kept, expected in zip(masks, want):
        np.testing.assert_allclose(whole.per_prompt(kept)[1], expected, rtol=0, atol=1e-9)
