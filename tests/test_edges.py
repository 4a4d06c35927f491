"""Edge circuits: the exact evaluation against the unpatched model and hand-written patches, and
EAP scores against finite differences (the graph and the plans: test_edges_plan.py)."""

import dataclasses

import numpy as np
import pytest
import torch

from attnlab.attention import sparse
from attnlab.interventions import intervened
from attnlab.interventions.edges import EdgePatch, Graph, ReceiverGradients, Recording
from attnlab.patching.edges import EdgeCircuits
from attnlab.patching.heads import TaskBatch
from test_attention import TINY
from test_pruning import _toy_batch


def _norms_in_float64(model) -> None:
    """Makes ``model``'s RMS norms compute in its own dtype: transformers' compute in float32 even
    in a float64 model, so a float64 run rounds every layer to float32 and a 1-ulp float64
    difference grew to 6e-6 of Gemma-3-270M's metric; with these, 64 ulp at every sublayer moved
    it < 1e-12. The weight is rounded as transformers does ((1 + w) in float32 for Gemma-3)."""
    one = {"LlamaRMSNorm": 0.0, "Qwen2RMSNorm": 0.0, "Gemma3RMSNorm": 1.0}
    for norm in model.modules():
        name = type(norm).__name__
        if name.endswith("Norm"):
            assert name in one, f"{name}: add its formula here"
            eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))

            def forward(x, norm=norm, one=one[name], eps=eps):
                weight = (one + norm.weight.float()).to(x.dtype)
                return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
            norm.forward = forward


def _model(arch: str, sparse_copy: bool = False, dtype=torch.float32):
    """A tiny model; in float64 its norms too (``_norms_in_float64``)."""
    model = TINY[arch]()
    if sparse_copy:
        sparse.make_sparse(model, 0.0)  # about half the edges gated shut (0.5 shuts none here)
    model = model.to(dtype)
    if dtype == torch.float64:
        _norms_in_float64(model)
    return model


def _plain_metric(model, batch: TaskBatch, ids: torch.Tensor) -> np.ndarray:
    positions = (batch.mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=batch.mask, position_ids=positions).logits
    return batch.metric(logits, slice(0, batch.n_prompts)).double().numpy()


def _shared_prefixes(batch: TaskBatch) -> TaskBatch:
    """The batch with row i's corrupted prompt sharing its first i tokens with the clean one and
    two rows left-padded: patching then reads only the tokens from each first difference on."""
    clean, corrupted, mask = batch.clean.clone(), batch.corrupted.clone(), batch.mask.clone()
    for row in range(len(clean)):
        corrupted[row, :row] = clean[row, :row]
    for row, pad in ((1, 2), (3, 1)):
        clean[row, :pad] = corrupted[row, :pad] = 0
        mask[row, :pad] = 0
    return dataclasses.replace(batch, clean=clean, corrupted=corrupted, mask=mask)


BATCHES = {"toy": lambda: _toy_batch(), "shared-prefixes": lambda: _shared_prefixes(_toy_batch())}


@pytest.mark.parametrize("shape", BATCHES)
@pytest.mark.parametrize("arch,sparse_copy", [("llama-gqa", False), ("qwen2", False), ("gemma3-sliding", False),
                                              ("llama-gqa", True)])
def test_all_edges_give_the_clean_run_and_none_the_corrupted_run(arch, sparse_copy, shape):
    model = _model(arch, sparse_copy)
    batch = BATCHES[shape]()
    circuits = EdgeCircuits(model, batch, batch_size=4)
    every = circuits.graph.valid()
    _, kept_all = circuits.per_prompt(every)
    _, kept_none = circuits.per_prompt(torch.zeros_like(every))
    np.testing.assert_allclose(kept_all, _plain_metric(model, batch, batch.clean), atol=1e-5, rtol=0)
    np.testing.assert_allclose(kept_none, _plain_metric(model, batch, batch.corrupted), atol=1e-5, rtol=0)


def _float64_batch(shape: str = "toy"):
    batch = BATCHES[shape]()

    def metric(logits, prompts):  # float64 throughout, for finite differences
        return logits[:, -1, 3] - logits[:, -1, 5]
    return TaskBatch(batch.clean, batch.corrupted, batch.mask, batch.templates, metric, read_positions=1)


class _ByHand:
    """Runs of a tiny Llama with hooks written here: the clean and corrupted runs' embeddings and
    layer-0 o_proj inputs, and patched runs that shift one receiver's input."""

    def __init__(self, model, batch):
        self.model, self.batch = model, batch
        self.positions = (batch.mask.cumsum(-1) - 1).clamp(min=0)
        self.z = {}
        self.embeds = {}
        for name, ids in (("clean", batch.clean), ("corrupted", batch.corrupted)):
            handle = model.model.layers[0].self_attn.o_proj.register_forward_pre_hook(
                lambda module, args, name=name: self.z.__setitem__(name, args[0].detach().clone()))
            self._run(ids)
            handle.remove()
            self.embeds[name] = model.model.embed_tokens(ids).detach()

    def _run(self, ids) -> np.ndarray:
        with torch.no_grad():
            logits = self.model(input_ids=ids, attention_mask=self.batch.mask, position_ids=self.positions).logits
        return self.batch.metric(logits, slice(0, self.batch.n_prompts)).double().numpy()

    def head_output(self, name: str, head: int) -> torch.Tensor:
        """Layer 0, ``head``'s contribution to the residual stream: its o_proj slice."""
        dim = self.model.config.head_dim
        o_proj = self.model.model.layers[0].self_attn.o_proj.weight
        return self.z[name][..., head * dim:(head + 1) * dim] @ o_proj[:, head * dim:(head + 1) * dim].T

    def logits_shifted(self, shift: torch.Tensor) -> np.ndarray:
        """The clean run with the final norm's input shifted by ``shift``."""
        handle = self.model.model.norm.register_forward_pre_hook(lambda module, args: (args[0] + shift,))
        try:
            return self._run(self.batch.clean)
        finally:
            handle.remove()

    def query_shifted(self, layer: int, head: int, shift: torch.Tensor) -> np.ndarray:
        """The clean run with ``head``'s query input at ``layer`` shifted by ``shift`` (the other
        heads' queries, and every key and value, read the residual stream as it is)."""
        block = self.model.model.layers[layer]
        dim = self.model.config.head_dim
        seen = {}
        pre = block.register_forward_pre_hook(lambda module, args, kwargs: seen.__setitem__("x", kwargs.get(
            "hidden_states", args[0] if args else None)), with_kwargs=True)

        def patch(module, args, output):
            out = output.clone()
            own = module.forward(block.input_layernorm(seen["x"] + shift))  # forward: not this hook again
            out[..., head * dim:(head + 1) * dim] = own[..., head * dim:(head + 1) * dim]
            return out
        post = block.self_attn.q_proj.register_forward_hook(patch)
        try:
            return self._run(self.batch.clean)
        finally:
            pre.remove()
            post.remove()


@pytest.mark.parametrize("shape", BATCHES)
def test_dropping_one_edge_equals_a_patch_written_by_hand(shape):
    model = _model("llama-gqa", dtype=torch.float64)
    batch = _float64_batch(shape)
    circuits = EdgeCircuits(model, batch, batch_size=6)
    graph, hand = circuits.graph, _ByHand(model, batch)
    every = graph.valid()

    dropped = every.clone()
    dropped[0, graph.logits_receiver] = False  # embeddings -> logits
    want = hand.logits_shifted(hand.embeds["corrupted"] - hand.embeds["clean"])
    np.testing.assert_allclose(circuits.per_prompt(dropped)[1], want, atol=1e-9, rtol=0)

    dropped = every.clone()
    dropped[graph.head_sender(0, 1), graph.attention_slice(1).start + 2] = False  # L0.H1 -> L1.H2.q
    want = hand.query_shifted(1, 2, hand.head_output("corrupted", 1) - hand.head_output("clean", 1))
    np.testing.assert_allclose(circuits.per_prompt(dropped)[1], want, atol=1e-9, rtol=0)
    assert np.abs(want - _plain_metric(model, batch, batch.clean)).max() > 1e-5  # the patch did something


# The same scores against finite differences of a forward written in float64:
# tests/test_edges_references.py
@pytest.mark.parametrize("shape", BATCHES)
def test_one_step_scores_equal_finite_differences(shape):
    model = _model("llama-gqa", dtype=torch.float64)
    batch = _float64_batch(shape)
    circuits = EdgeCircuits(model, batch, batch_size=6)
    graph, hand = circuits.graph, _ByHand(model, batch)
    scores = circuits.scores(steps=1)

    def central(metric_shifted_by, eps=1e-4):
        """d mean-metric / dt at t = 0, the receiver's input shifted by −t (clean − corrupted) of
        the sender: minus the score's linear estimate."""
        return (metric_shifted_by(eps).mean() - metric_shifted_by(-eps).mean()) / (2 * eps)

    # rel=1e-6: 17x the scores' float32 rounding (6e-8); the quotient's own error at a step of 1e-4
    # is O(step²) ~3e-9 relative (seen: <3e-8 with both); abs=1e-10: 20x its float64 noise (~1e-15/step)
    difference = hand.embeds["clean"] - hand.embeds["corrupted"]
    estimate = -central(lambda t: hand.logits_shifted(-t * difference))
    assert scores[0, graph.logits_receiver].item() == pytest.approx(estimate, rel=1e-6, abs=1e-10)

    # the layer-0 head -> layer-1 query edge with the largest score
    heads = [graph.head_sender(0, head) for head in range(graph.n_heads)]
    queries = graph.attention_slice(1).start + torch.arange(graph.n_heads)
    sender, query = divmod(int(scores[heads][:, queries].abs().argmax()), graph.n_heads)
    difference = hand.head_output("clean", sender) - hand.head_output("corrupted", sender)
    estimate = -central(lambda t: hand.query_shifted(1, query, -t * difference))
    assert scores[heads[sender], queries[query]].item() == pytest.approx(estimate, rel=1e-6, abs=1e-10)
    assert abs(estimate) > 1e-5


def _receiver_gradients_by_hand(model, batch) -> torch.Tensor:
    """[receivers, rows, tokens, hidden]: the gradient of the summed metric at each receiver's
    input, by hooks written here: a zero leaf added to each receiver's own input (every query,
    key and value head its own copy of the layer's input, normed and projected for its slice
    alone; every MLP and the logits their pre-norm's input)."""
    graph = Graph.of(model)
    positions = (batch.mask.cumsum(-1) - 1).clamp(min=0)
    shape = (*batch.clean.shape, model.config.hidden_size)
    leaves = torch.zeros(graph.n_receivers, *shape, dtype=torch.float64, requires_grad=True)
    handles, seen = [], {}
    for index, block in enumerate(model.model.layers):
        handles.append(block.register_forward_pre_hook(lambda module, args, kwargs, index=index: seen.__setitem__(
            index, kwargs.get("hidden_states", args[0] if args else None)), with_kwargs=True))
        first = graph.attention_slice(index).start
        h, g = graph.n_heads, graph.n_kv_heads
        for name, start, heads in (("q_proj", first, h), ("k_proj", first + h, g), ("v_proj", first + h + g, g)):
            def own_inputs(module, args, output, index=index, start=start, heads=heads, block=block):
                out, width = output.clone(), output.shape[-1] // heads
                for head in range(heads):
                    own = module.forward(block.input_layernorm(seen[index] + leaves[start + head]))
                    out[..., head * width:(head + 1) * width] = own[..., head * width:(head + 1) * width]
                return out
            handles.append(getattr(block.self_attn, name).register_forward_hook(own_inputs))
        mlp_norm = getattr(block, "pre_feedforward_layernorm", block.post_attention_layernorm)
        handles.append(mlp_norm.register_forward_pre_hook(
            lambda module, args, index=index: (args[0] + leaves[graph.mlp_receiver(index)],)))
    handles.append(model.model.norm.register_forward_pre_hook(
        lambda module, args: (args[0] + leaves[graph.logits_receiver],)))
    try:
        logits = model(input_ids=batch.clean, attention_mask=batch.mask, position_ids=positions).logits
    finally:
        for handle in handles:
            handle.remove()
    batch.metric(logits, slice(0, batch.n_prompts)).sum().backward()
    return leaves.grad


@pytest.mark.parametrize("arch,sparse_copy", [("llama-gqa", False), ("qwen2", False), ("gemma3-sliding", False),
                                              ("llama-gqa", True)])
def test_receiver_gradients_equal_autograd_through_each_receivers_own_input(arch, sparse_copy):
    """The gradients EAP-IG scores with come from the projections' output gradients taken back
    through the pre-norm in closed form; autograd through per-receiver inputs must agree."""
    model = _model(arch, sparse_copy, dtype=torch.float64)
    model.requires_grad_(False)
    batch = _float64_batch()
    graph = Graph.of(model)
    want = _receiver_gradients_by_hand(model, batch)
    gradients = ReceiverGradients()
    positions = (batch.mask.cumsum(-1) - 1).clamp(min=0)
    with intervened(model, edges=EdgePatch(graph, gradients=gradients)):
        logits = model(input_ids=batch.clean, attention_mask=batch.mask, position_ids=positions).logits
    batch.metric(logits, slice(0, batch.n_prompts)).sum().backward()
    got = torch.cat([gradients.gradient(graph.attention_slice(layer).start) for layer in range(graph.n_layers)]
                    + [gradients.gradient(graph.logits_receiver)]).view_as(want)  # kept at every token
    assert want.abs().amax(dim=(1, 2, 3)).min() > 0  # every receiver matters on this model
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10 * float(want.abs().max()))  # seen: 3e-16


def test_gradients_on_a_patched_pass_are_refused():
    graph = Graph(n_layers=2, n_heads=4, n_kv_heads=2)
    with pytest.raises(ValueError, match=r"gradients=\) are taken on unpatched passes"):
        EdgePatch(graph, kept=graph.valid(), corrupted=Recording(), gradients=ReceiverGradients())


@pytest.mark.parametrize("arch", ["llama-gqa", "gemma3-sliding"])
def test_a_patched_pass_computes_only_the_patched_tokens_and_the_same_metrics(arch):
    """Before a prompt's first clean/corrupted difference every pass computes what the corrupted
    run did: a patched pass runs the MLPs and o_proj only from there on (a prompt the same in
    both runs not at all), and gives the metrics of a pass patched at every token."""
    model = _model(arch)
    batch = _shared_prefixes(_toy_batch())
    batch.corrupted[2] = batch.clean[2]  # nothing differs: this prompt's metric is the clean one
    circuits = EdgeCircuits(model, batch, batch_size=6)
    graph = circuits.graph
    kept = graph.valid() & (torch.rand(graph.n_senders, graph.n_receivers,
                                       generator=torch.Generator().manual_seed(3)) < 0.3)
    rows = slice(0, len(batch.clean))
    points = batch.differing_points(rows)
    assert 0 < len(points) < batch.clean.numel()
    circuits.corrupted  # recorded at every token
    seen = {"mlp": [], "o_proj": []}  # tokens each runs on (o_proj: none where the heads' differences give it)
    layer = model.model.layers[1]
    hooks = [module.register_forward_pre_hook(lambda module, args, name=name: seen[name].append(
        args[0].shape[:-1].numel())) for name, module in (("mlp", layer.mlp), ("o_proj", layer.self_attn.o_proj))]
    restricted = circuits.per_prompt(kept)[1]
    for hook in hooks:
        hook.remove()
    assert seen["mlp"] == [len(points)] and set(seen["o_proj"]) <= {len(points)}
    everywhere, _ = circuits._record(batch.corrupted, rows)
    with torch.no_grad():
        logits = circuits._logits(rows, EdgePatch(graph, kept=kept, corrupted=everywhere), ids=batch.clean)
    np.testing.assert_allclose(restricted, batch.metric(logits, rows).numpy(), atol=1e-5, rtol=0)
    np.testing.assert_allclose(restricted[2], _plain_metric(model, batch, batch.clean)[2], atol=1e-5, rtol=0)
    assert np.abs(restricted - _plain_metric(model, batch, batch.clean)).max() > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("model_dir", ["smollm2_dir", "gemma3_dir"])
def test_embedded_models_all_edges_clean_none_corrupted_to_1e5(model_dir, request):
    """The issue's exactness on the real models (Gemma-3: sandwich norms, whose scale is split
    between heads), on IOI prompts with their own metric. In float64 throughout (model, norms,
    metric): in float32 the two sides differ by ~1e-5 after 18 layers, by CPU and thread count."""
    from attnlab.models import load_model
    from attnlab.patching.heads import build_batch
    from attnlab.patching.tasks import generate_task
    from attnlab.tokenization import load_tokenizer

    path = request.getfixturevalue(model_dir)
    tokenizer = load_tokenizer(path)
    model = load_model(path, torch.device("cpu"), torch.float64)
    _norms_in_float64(model)
    task = generate_task("ioi", tokenizer, 6, 0)
    answers, distractors = torch.tensor(task.answers), torch.tensor(task.distractors)

    def metric(logits, prompts):  # the IOI metric without build_batch's rounding to float32
        last = logits[:, -1]
        return last.gather(1, answers[prompts, None])[:, 0] - last.gather(1, distractors[prompts]).max(1).values
    batch = dataclasses.replace(build_batch(task, tokenizer), metric=metric)  # left-padded rows
    circuits = EdgeCircuits(model, batch, batch_size=6)
    every = circuits.graph.valid()
    # observed 2e-14 (metrics ~2-6), <1e-12 with 64 ulp of noise at every sublayer: 1e-9 has >1e3x
    # margin for any summation order, and dropping one edge moved a metric by 4e-3 to 2. Finite:
    # NaN rows (eager float64 attention on left padding) would compare equal on both sides.
    for kept, ids in ((every, batch.clean), (torch.zeros_like(every), batch.corrupted)):
        patched, plain = circuits.per_prompt(kept)[1], _plain_metric(model, batch, ids)
        assert np.isfinite(plain).all()
        np.testing.assert_allclose(patched, plain, atol=1e-9, rtol=0, equal_nan=False)


@pytest.mark.parametrize("shape", BATCHES)
@pytest.mark.parametrize("arch", ["llama-gqa", "gemma3-sliding"])
def test_a_random_circuit_is_the_same_from_either_base(arch, shape):
    """Each receiver reads live − Σ dropped (live − corrupted) or corrupted + Σ kept (live −
    corrupted), whichever it keeps less of: forcing every receiver onto one base, then the other,
    gives the same metrics, and they differ from both ends."""
    from attnlab.interventions.edges import EdgePatch, Plan

    model = _model(arch)
    batch = BATCHES[shape]()
    circuits = EdgeCircuits(model, batch, batch_size=6)
    graph = circuits.graph
    kept = graph.valid() & (torch.rand(graph.n_senders, graph.n_receivers,
                                       generator=torch.Generator().manual_seed(0)) < 0.3)
    rows = slice(0, len(batch.clean))
    metrics = []
    for live in (True, False):
        patch = EdgePatch(graph, kept=kept, corrupted=circuits.corrupted[0])
        patch.plan = Plan.of(graph, kept, base="live" if live else "corrupted")
        assert bool(patch.plan.live_base.all()) == live
        with torch.no_grad():
            metrics.append(batch.metric(circuits._logits(rows, patch, ids=batch.clean), rows).numpy())
    np.testing.assert_allclose(metrics[0], metrics[1], atol=1e-4, rtol=0)
    assert np.abs(metrics[0] - circuits.per_prompt(kept)[1]).max() < 1e-4
    # patched at every token, not only from each prompt's first difference on: the same
    everywhere, _ = circuits._record(batch.corrupted, rows)
    with torch.no_grad():
        logits = circuits._logits(rows, EdgePatch(graph, kept=kept, corrupted=everywhere), ids=batch.clean)
    np.testing.assert_allclose(batch.metric(logits, rows).numpy(), circuits.per_prompt(kept)[1], atol=1e-5, rtol=0)
    for end in (circuits.metric(), circuits.corrupted_metric()):
        assert abs(metrics[0].mean() - end) > 1e-3
