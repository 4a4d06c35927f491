"""One intervention context: every part installed on entry, nothing of it left after the block."""

import threading

import numpy as np
import pytest
import torch

from attnlab import interventions
from attnlab.attention import sparse
from attnlab.attention.reduction import BatchReduction
from attnlab.interventions import intervened
from attnlab.interventions.mlp import ActivationRecorder, ArmSettings
from attnlab.patching.heads import HeadGates
from test_attention import TINY


def _hooks(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def _everything(model, ids):
    """Every part at once on ``model`` (sparse), for one forward; returns what each recorded."""
    head_gates = HeadGates(model)
    head_gates.reference = [torch.zeros(*ids.shape, 64) for _ in range(3)]
    tracker = sparse.GateTracker()
    reduce = BatchReduction(torch.ones_like(ids, dtype=torch.bool), torch.zeros_like(ids, dtype=torch.bool))
    recorder = ActivationRecorder(1, 0.01, np.linspace(-1, 1, 5))
    recorder.mask = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad(), intervened(model, gates=tracker, gate_bias=0.0, reduce=reduce, head_gates=head_gates,
                                     arm=ArmSettings(layer=0), activations=recorder) as inside:
        assert interventions.current() is inside and inside.reduce is reduce and inside.gates is tracker
        logits = model(ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
    return logits, tracker, reduce, recorder


def test_nothing_outlives_the_block_and_a_second_use_starts_clean():
    model = TINY["llama-gqa"]()
    sparse.make_sparse(model, 6.0)
    ids = torch.randint(3, 101, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(ids).logits
    hooks = _hooks(model)
    first, tracker, reduce, recorder = _everything(model, ids)
    assert not torch.allclose(first, plain)  # the parts did act
    assert len(tracker.open_per_head) == 3 and len(reduce.received) == 3 and len(recorder.rows) == 1
    assert interventions.current().gates is None and interventions.current().reduce is None
    assert _hooks(model) == hooks
    assert model.config._attn_implementation == interventions.IMPLEMENTATION
    assert sparse.layer_bias(getattr(model.config, sparse.CONFIG_KEY)["gate_bias"], 0) == 6.0  # own bias kept
    with torch.no_grad():
        assert torch.equal(model(ids).logits, plain)
    second, *_ = _everything(model, ids)
    assert torch.equal(second, first)  # the same parts give the same result: no state carried over


def test_an_exception_inside_the_block_removes_everything():
    model = TINY["llama-gqa"]()
    hooks, implementation = _hooks(model), model.config._attn_implementation
    reduce = BatchReduction(torch.ones(1, 4, dtype=torch.bool), torch.zeros(1, 4, dtype=torch.bool))
    with pytest.raises(KeyError):
        with intervened(model, reduce=reduce, head_gates=HeadGates(model), arm=ArmSettings(layer=1)):
            assert model.config._attn_implementation == interventions.IMPLEMENTATION
            raise KeyError("inside")
    assert _hooks(model) == hooks and model.config._attn_implementation == implementation
    assert interventions.current().reduce is None


def test_nested_blocks_add_their_parts_and_restore_the_outer_ones():
    model = TINY["llama-gqa"]()
    sparse.make_sparse(model, 6.0)
    outer, inner = sparse.GateTracker(), sparse.GateTracker()
    with intervened(model, gate_bias=-1.0):
        with intervened(model, gates=inner) as inside:
            assert inside.gate_bias == -1.0 and inside.gates is inner
        assert interventions.current().gates is None and interventions.current().gate_bias == -1.0
        with intervened(model, gates=outer):
            with torch.no_grad():
                model(torch.tensor([[5, 6, 7, 8]]))
    assert outer.inference_density() < 1.0  # measured at the block's bias, not the model's 6.0
    assert interventions.current().gate_bias is None


def test_parts_that_do_not_fit_the_model_are_refused():
    dense = TINY["llama-gqa"]()
    with pytest.raises(ValueError, match="need a sparse model"):
        with intervened(dense, gates=sparse.GateTracker()):
            pass
    model = TINY["llama-gqa"]()
    sparse.make_sparse(model, 1.0)
    with pytest.raises(ValueError, match="one value per decoder layer"):
        with intervened(model, gate_bias=[1.0, 2.0]):
            pass
    training = sparse.GateTracker(training=True, generator=torch.Generator().manual_seed(0))
    reduce = BatchReduction(torch.ones(1, 4, dtype=torch.bool), torch.zeros(1, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="do not mix"):
        with intervened(model, gates=training, reduce=reduce):
            pass
    assert interventions.current().gates is None


def test_a_recomputation_on_another_thread_sees_its_forward_parts():
    """On GPUs the backward pass (and a checkpointed layer's recomputation) runs on an autograd
    worker thread, where the caller's context variables are not visible: recompute_context
    carries them over."""
    model = TINY["llama-gqa"]()
    sparse.make_sparse(model, 1.0)
    tracker = sparse.GateTracker()
    seen = {}
    with intervened(model, gates=tracker):
        _, recompute = interventions.recompute_context()

    def worker():
        seen["bare"] = interventions.current().gates
        with recompute:
            seen["carried"] = interventions.current().gates
        seen["after"] = interventions.current().gates

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == {"bare": None, "carried": tracker, "after": None}
