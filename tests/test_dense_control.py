"""A sparse copy's dense control (constraint ce_control) is the base fine-tuned on the copy's own
batches, no gates: its saved folder must equal a dense fine-tune written here by hand on the same
batches, and differ from the base."""

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from attnlab import sparsify
from sparse_tiny import tiny_settings


def _hand_fine_tune(base, batches: list[torch.Tensor], lr: float, grad_clip: float) -> torch.nn.Module:
    """The reference: the base in float32, every weight trained with AdamW at a constant rate,
    the mean next-token cross-entropy, the gradient's norm clipped, one step per batch."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    for ids in batches:
        logits = model(input_ids=ids, use_cache=False).logits.double()
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
    return model.eval()


def test_the_control_folder_is_a_dense_fine_tune_on_the_copys_batches(tiny_base, tmp_path, monkeypatch):
    base, corpus = tiny_base
    settings = tiny_settings(corpus, steps=3, train="all", lr_schedule="constant", warmup_steps=1,
                             constraint={"type": "ce_control", "slack": 0.1}, eval_every=3)
    seen = []
    real_step = sparsify.Trainer._control_step

    def recording(self, ids, step):
        seen.append(ids.detach().clone())
        return real_step(self, ids, step)

    monkeypatch.setattr(sparsify.Trainer, "_control_step", recording)
    result = sparsify.post_train(str(base), "tiny-sparse", settings, str(tmp_path / "ckpt.pt"), torch.device("cpu"))
    assert sparsify.write_control(result, "tiny-sparse", str(tmp_path / "control"))
    assert len(seen) == 3  # one control step per training step, on the copy's batch
    control = AutoModelForCausalLM.from_pretrained(tmp_path / "control", dtype=torch.float32).eval()
    reference = _hand_fine_tune(base, seen, settings["lr"], settings["grad_clip"])
    plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    probe = torch.cat(seen[:2])
    with torch.no_grad():
        logits, expected, before = (m(input_ids=probe).logits for m in (control, reference, plain))
    assert not hasattr(control.config, "attnlab_sparse")  # no gates: a plain model of the base's family
    torch.testing.assert_close(logits, expected, atol=2e-4, rtol=1e-4)
    assert (logits - before).abs().max() > 100 * (logits - expected).abs().max()  # it moved from the base
