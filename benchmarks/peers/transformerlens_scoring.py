"""TransformerLens's head scoring on IOI pairs, for the peer worker (benchmarks/peers/heads_worker.py,
run in .venv-peers): exact patching in attnlab's direction and in TransformerLens's own, and
attribution patching; each a run the worker times, beside an untimed metric and a warm-up."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from benchmarks.peers import measuring


def _ioi_tensors(ioi):
    """Right-padded clean/corrupted ids (padding after the last token cannot change a
    causal model's earlier positions) and each row's last real position."""
    width = max(len(r) for r in ioi["clean"])
    pad = ioi["pad_id"]
    clean = torch.tensor([r + [pad] * (width - len(r)) for r in ioi["clean"]])
    corrupted = torch.tensor([r + [pad] * (width - len(r)) for r in ioi["corrupted"]])
    last = torch.tensor([len(r) - 1 for r in ioi["clean"]])
    return clean.to(measuring.DEVICE), corrupted.to(measuring.DEVICE), last.to(measuring.DEVICE)


def scoring_transformerlens(model_dir, ioi, method):
    """(run, extra) of one scoring method: run() returns scores [layers, heads]; extra holds the
    untimed ``metrics`` and the ``warm`` forward the worker runs before it is timed."""
    from transformer_lens.model_bridge import TransformerBridge

    bridge = TransformerBridge.boot_transformers(model_dir, device=measuring.DEVICE, dtype=torch.float32)
    pairs = IoiPairs.of(ioi)
    methods = {"exact": lambda: exact(bridge, pairs, ioi.get("same_direction_every", 1)),
               "exact_denoising": lambda: exact_denoising(bridge, pairs),
               "attribution": lambda: attribution(bridge, pairs)}

    def metrics():  # untimed
        with torch.no_grad():
            return {"clean_metric": float(pairs.metric(bridge(pairs.clean))),
                    "corrupted_metric": float(pairs.metric(bridge(pairs.corrupted)))}

    def warm():
        with torch.no_grad():
            bridge(pairs.clean)
    return methods[method], {"metrics": metrics, "warm": warm}


@dataclass
class IoiPairs:
    """The pairs on the worker's device, and the metric every method scores with."""
    clean: torch.Tensor
    corrupted: torch.Tensor
    last: torch.Tensor
    answers: torch.Tensor
    wrong: torch.Tensor

    @classmethod
    def of(cls, ioi) -> "IoiPairs":
        clean, corrupted, last = _ioi_tensors(ioi)
        return cls(clean, corrupted, last, torch.tensor(ioi["answers"], device=measuring.DEVICE),
                   torch.tensor(ioi["distractors"], device=measuring.DEVICE))

    def metric(self, logits):
        """Mean logit difference over the batch, at each row's last token."""
        rows = torch.arange(len(self.last), device=self.last.device)
        final = logits[rows, self.last].float()
        return (final[rows, self.answers] - final[rows, self.wrong]).mean()


def exact(bridge, pairs: IoiPairs, every: int) -> np.ndarray:
    """attnlab's direction: each head of the clean run given the corrupted run's output; every
    ``every``-th head (all when 1), a check that the numbers are attnlab's."""
    import pandas as pd
    from transformer_lens.patching import generic_activation_patch, layer_head_vector_patch_setter

    layers, heads = bridge.cfg.n_layers, bridge.cfg.n_heads
    names = [f"blocks.{layer}.attn.hook_z" for layer in range(layers)]
    heads_patched = [(l, h) for l in range(layers) for h in range(heads) if (l * heads + h) % every == 0]
    with torch.no_grad():
        full = pairs.metric(bridge(pairs.clean))
        _, corrupted_cache = bridge.run_with_cache(pairs.corrupted, names_filter=names)
        # TransformerLens patches a run with another run's cached activations. To get
        # attnlab's quantity (ablate a head of the clean run by giving it the corrupted
        # run's output), the clean run is the one patched, from the corrupted cache.
        # (get_act_patch_attn_head_out_all_pos is this call over every (layer, head).)
        patched = generic_activation_patch(
            bridge, pairs.clean, corrupted_cache, pairs.metric, layer_head_vector_patch_setter, "z",
            index_df=pd.DataFrame(heads_patched, columns=["layer", "head"]))
    scores = np.full((layers, heads), np.nan, np.float32)
    for (layer, head), value in zip(heads_patched, (full - patched).cpu().numpy()):
        scores[layer, head] = value
    return scores


def exact_denoising(bridge, pairs: IoiPairs) -> np.ndarray:
    """TransformerLens's own direction: each head's clean output patched into the corrupted
    run; score = how much of the metric it restores."""
    from transformer_lens.patching import get_act_patch_attn_head_out_all_pos

    names = [f"blocks.{layer}.attn.hook_z" for layer in range(bridge.cfg.n_layers)]
    with torch.no_grad():
        floor = pairs.metric(bridge(pairs.corrupted))
        _, clean_cache = bridge.run_with_cache(pairs.clean, names_filter=names)
        patched = get_act_patch_attn_head_out_all_pos(bridge, pairs.corrupted, clean_cache, pairs.metric)
    return (patched - floor).cpu().numpy()


def attribution(bridge, pairs: IoiPairs) -> np.ndarray:
    """Attribution patching pair by pair (each unpadded), summed over positions, averaged."""
    from transformer_lens.tools.analysis.attribution_patching import attribution_patch

    scores = torch.zeros(bridge.cfg.n_layers, bridge.cfg.n_heads)
    for i in range(len(pairs.last)):
        n = int(pairs.last[i]) + 1

        def pair_metric(logits, i=i):
            return logits[0, -1, pairs.answers[i]] - logits[0, -1, pairs.wrong[i]]
        result = attribution_patch(bridge, pairs.clean[i:i + 1, :n], pairs.corrupted[i:i + 1, :n], pair_metric)
        for node, score in result.node_scores.items():
            if node.kind == "attn_head_out":  # one node per (layer, head, position)
                scores[node.layer, node.head] += float(score)  # a CUDA scalar cannot add into a CPU tensor
    return (scores / len(pairs.last)).numpy()
