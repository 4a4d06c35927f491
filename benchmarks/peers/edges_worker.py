"""Run the peer library auto-circuit (PyPI ``auto-circuit`` 1.0.1) on a local Hugging Face Llama
folder (SmolLM2-135M-Instruct) and a fixed batch of IOI prompt pairs, and write its edge scores
under attnlab's edge names so that they can be compared with attnlab's ``EdgeCircuits.scores``.

Run it in its own virtualenv (``benchmarks/peers/autocircuit-requirements.txt``)::

    .venv-autocircuit/bin/python -m benchmarks.peers.edges_worker \
        --model resources/models/smollm2-135m --inputs /tmp/edge_peer/inputs.json --out /tmp/edge_peer

Inputs: ``inputs.json`` with ``clean``, ``corrupted`` (lists of equal-length token-id lists, no
padding), ``answers`` (one token id per prompt) and ``distractors`` (a list of token ids per prompt).

What it computes (one batch holding every prompt; patching is over all positions at once, i.e.
``patchable_model(seq_len=None)``, as attnlab sums its scores over positions):

- ``autocircuit_eap.csv``: ``edge_attribution_patching_prune_scores`` (auto-circuit's reference
  EAP, gradient of the metric at the clean input times the senders' clean − corrupted outputs).
  Also checked against ``mask_gradient_prune_scores(grad_function="logit", mask_val=0)``, which
  auto-circuit documents as the same quantity (the max abs difference is in the timing json).
- ``autocircuit_ig5.csv``: ``mask_gradient_prune_scores(grad_function="logit",
  answer_function="avg_diff", integrated_grad_samples=5)``. auto-circuit's integrated gradients
  interpolate the EDGE MASKS, not the input: every edge mask is set to α = k/5 for k = 0..5 (six
  points, both ends included), where α = 0 is the clean activation and α = 1 the corrupted
  (resample) one on every edge, and the mask gradients of the six forward/backward passes are
  SUMMED (not averaged). So the scale is about 6× a mean-gradient IG score, and the path runs
  from the clean run (α = 0) to the fully corrupted run (α = 1). auto-circuit 1.0.1 has no
  input-embedding interpolation option (``mask_gradient_prune_scores`` only takes ``mask_val``
  xor ``integrated_grad_samples``, plus ``ablation_type`` and ``clean_corrupt``).
- ``autocircuit_timing.json``: wall seconds of each algorithm and of one plain forward.
- ``autocircuit_curve.csv``: the metric when only the top-n edges (by |EAP score|) carry the
  clean activations and all others the corrupted ones (``run_circuits`` with
  ``PatchType.TREE_PATCH`` and ``AblationType.RESAMPLE``: input clean, the complement of the
  circuit patched with the corrupted run's sender outputs; this is attnlab's EdgePatch
  convention). n counts auto-circuit's edges (its K/V receivers are per query head).

Metric: logit[answer] − logit[distractor] at the last position, mean over prompts. auto-circuit's
``answer_function="avg_diff"`` (``batch_avg_answer_diff``) is mean(answers) − mean(wrong answers);
with exactly one distractor per prompt this is attnlab's logit[answer] − max logit[distractors].
The worker refuses inputs with more than one distractor per prompt.

Sign: auto-circuit minimises loss = −metric, and its mask interpolates clean (0) → corrupted
(1), so a mask gradient is −∂m/∂x·(corrupted − clean) = ∂m/∂x·(clean − corrupted); its
reference EAP computes grad(−m)·(corrupted − clean), the same. This is attnlab's convention
(positive when the edge carries the clean effect); scores are written raw, no flip.

Model: TransformerLens ``HookedTransformer`` built from the local folder with
``get_pretrained_model_config(path)`` + ``get_pretrained_state_dict(path, hf_model=...)`` and no
weight processing (fold_ln / centering / value-bias folding all off), and
``use_attn_result``, ``use_split_qkv_input``, ``use_hook_mlp_in`` on. auto-circuit 1.0.1 needs a
``transformer_lens.HookedTransformer``, which TransformerLens 4.x removed (only
TransformerBridge is left), so this runs on TransformerLens 3.9.0, the last line that has both
HookedTransformer and transformers 5 support. auto-circuit also imports
``HookedTransformerKeyValueCache`` / ``transformer_lens.past_key_value_caching`` (renamed
``TransformerLensKeyValueCache`` in TL 3); a two-line alias shim below provides those names
(it is only used as a type in auto-circuit's code paths used here).

Grouped-query attention: auto-circuit's graph makes a Q, K and V receiver for every query head
(``A{l}.{h}.K``), indexing ``hook_k_input`` by query head, so the model is loaded with
``ungroup_grouped_query_attention=True`` (TL then repeats each key/value head's weights for its
query heads: same logits; ``hook_k_input``/``hook_v_input`` have 9 heads). attnlab has one K and
one V receiver per key/value head, so the K (V) scores of the 3 query heads sharing a key/value
head (kv = h // 3 for SmolLM2: 9 query heads, 3 kv heads) are SUMMED into ``L{l}.KV{kv}.k``
(``.v``). For these linear scores the sum is exact: the key/value head's input gradient is the
sum of its copies' gradients and all copies receive the same input.

Name mapping (auto-circuit → attnlab):
  senders   ``Resid Start`` (blocks.0.hook_resid_pre, the token embeddings; Llama has no
            positional embedding) → ``embed``; ``A{l}.{h}`` (attn.hook_result, head h's
            z_h·W_O[h], the o_proj slice) → ``L{l}.H{h}``; ``MLP {l}`` (hook_mlp_out) → ``L{l}.MLP``
  receivers ``A{l}.{h}.Q`` (hook_q_input, pre-RMSNorm) → ``L{l}.H{h}.q``; ``A{l}.{h}.K``/``.V`` →
            ``L{l}.KV{h//3}.k``/``.v`` (summed); ``MLP {l}`` (hook_mlp_in, pre-RMSNorm) → ``L{l}.MLP``;
            ``Resid End`` (blocks.{L-1}.hook_resid_post, the final norm's input) → ``logits``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import types
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402


def _shim_transformer_lens() -> None:
    """auto-circuit 1.0.1 imports names TransformerLens 3 renamed; alias them."""
    import transformer_lens as tl
    from transformer_lens.cache.key_value_cache import TransformerLensKeyValueCache

    if "transformer_lens.past_key_value_caching" not in sys.modules:
        mod = types.ModuleType("transformer_lens.past_key_value_caching")
        mod.HookedTransformerKeyValueCache = TransformerLensKeyValueCache
        sys.modules["transformer_lens.past_key_value_caching"] = mod
    if not hasattr(tl, "HookedTransformerKeyValueCache"):
        tl.HookedTransformerKeyValueCache = TransformerLensKeyValueCache


_shim_transformer_lens()

from transformer_lens import HookedTransformer  # noqa: E402
import transformer_lens.loading_from_pretrained as tl_loading  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from auto_circuit.data import PromptDataLoader, PromptDataset  # noqa: E402
from auto_circuit.prune import run_circuits  # noqa: E402
from auto_circuit.prune_algos.edge_attribution_patching import (  # noqa: E402
    edge_attribution_patching_prune_scores,
)
from auto_circuit.prune_algos.mask_gradient import mask_gradient_prune_scores  # noqa: E402
from auto_circuit.types import AblationType, PatchType  # noqa: E402
from auto_circuit.utils.graph_utils import patchable_model  # noqa: E402


def load_models(folder: str):
    """The HF model and the TransformerLens model of a local Llama folder, no weight processing."""
    path = os.path.abspath(folder)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf.eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    cfg = tl_loading.get_pretrained_model_config(path, fold_ln=False, device="cpu", dtype=torch.float32,
                                                 default_prepend_bos=False)
    cfg.use_attn_result = True
    cfg.use_split_qkv_input = True
    cfg.use_hook_mlp_in = True
    cfg.ungroup_grouped_query_attention = True
    state = tl_loading.get_pretrained_state_dict(path, cfg, hf_model=hf, dtype=torch.float32)
    tl = HookedTransformer(cfg, tokenizer, move_to_device=False)
    tl.load_and_process_state_dict(state, fold_ln=False, center_writing_weights=False, center_unembed=False,
                                   fold_value_biases=False, refactor_factored_attn_matrices=False)
    tl.eval()
    tl.requires_grad_(False)
    return hf, tl


def metric(logits_last: torch.Tensor, answers: torch.Tensor, distractors: torch.Tensor) -> torch.Tensor:
    """Per-prompt logit[answer] − max logit[distractors] from last-position logits [batch, vocab]."""
    a = logits_last.gather(-1, answers[:, None])[:, 0]
    d = logits_last.gather(-1, distractors).max(-1).values
    return a - d


def attnlab_names(edge, kv_group: int) -> tuple[str, str]:
    """An auto-circuit edge's (sender, receiver) in attnlab's names (module docstring)."""
    s, d = edge.src.name, edge.dest.name
    if s == "Resid Start":
        sender = "embed"
    elif s.startswith("MLP "):
        sender = f"L{s.split()[1]}.MLP"
    else:  # A{l}.{h}
        layer, head = s[1:].split(".")
        sender = f"L{layer}.H{head}"
    if d == "Resid End":
        receiver = "logits"
    elif d.startswith("MLP "):
        receiver = f"L{d.split()[1]}.MLP"
    else:  # A{l}.{h}.{Q|K|V}
        layer, head, letter = d[1:].split(".")
        if letter == "Q":
            receiver = f"L{layer}.H{head}.q"
        else:
            receiver = f"L{layer}.KV{int(head) // kv_group}.{letter.lower()}"
    return sender, receiver


def scores_by_name(model, prune_scores, kv_group: int) -> dict[tuple[str, str], float]:
    """auto-circuit prune scores → {(attnlab sender, attnlab receiver): score}, K/V summed per kv head."""
    out: dict[tuple[str, str], float] = defaultdict(float)
    for edge in model.edges:
        out[attnlab_names(edge, kv_group)] += float(prune_scores[edge.dest.module_name][edge.patch_idx])
    return out


def circuit_metrics(model, loader, circuits: dict[str, list], template, kv_group: int, answers, distractors) -> dict:
    """The mean metric of each circuit (attnlab edge names; a key/value-head edge stands for the
    edges into every query head of its group) with run_circuits: clean input, the circuit's edges
    clean, every other edge carrying the corrupted run's sender output."""
    results = {}
    for name, kept in circuits.items():
        chosen = {tuple(edge) for edge in kept}
        scores = {module: torch.zeros_like(tensor) for module, tensor in template.items()}
        count = 0
        for edge in model.edges:
            if attnlab_names(edge, kv_group) in chosen:
                scores[edge.dest.module_name][edge.patch_idx] = 1.0
                count += 1
        outs = run_circuits(model, loader, [count], scores, patch_type=PatchType.TREE_PATCH,
                            ablation_type=AblationType.RESAMPLE)
        logits = torch.cat(list(outs[count].values()))
        results[name] = {"autocircuit_edges": count, "metric": metric(logits, answers, distractors).mean().item()}
        print(name, results[name], flush=True)
    return results


def write_scores(path: Path, scores: dict[tuple[str, str], float]) -> None:
    import pandas as pd

    frame = pd.DataFrame([(s, r, v) for (s, r), v in scores.items()], columns=["sender_name", "receiver_name", "score"])
    frame.to_csv(path, index=False)


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="resources/models/smollm2-135m")
    parser.add_argument("--inputs", default="/tmp/edge_peer/inputs.json")
    parser.add_argument("--out", default="/tmp/edge_peer")
    parser.add_argument("--ig-samples", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-curve", action="store_true")
    parser.add_argument("--circuits", help="JSON {name: [[sender, receiver], ...]} in attnlab's names: each "
                        "circuit's metric to autocircuit_circuits.json")
    parser.add_argument("--skip-slow-eap", action="store_true",
                        help="use mask_gradient(mask_val=0) for the EAP file instead of the per-edge reference EAP")
    return parser.parse_args()


class Timing(dict):
    """The run's timings and checks, written to autocircuit_timing.json after each algorithm."""

    def __init__(self, out: Path, **fields):
        super().__init__(**fields)
        self.out = out

    def save(self) -> None:
        (self.out / "autocircuit_timing.json").write_text(json.dumps(self, indent=2))

    def timed(self, name, fn):
        t0 = time.perf_counter()
        result = fn()
        self[f"{name}_s"] = time.perf_counter() - t0
        print(name, self[f"{name}_s"], flush=True)
        return result


def read_pairs(path: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(clean, corrupted, answers, distractors) from inputs.json (one distractor per prompt)."""
    data = json.loads(Path(path).read_text())
    if any(len(d) != 1 for d in data["distractors"]):
        raise SystemExit("auto-circuit's avg_diff equals logit[answer] - max logit[distractors] only with one distractor")
    return (torch.tensor(data["clean"]), torch.tensor(data["corrupted"]), torch.tensor(data["answers"]),
            torch.tensor(data["distractors"]))


def check_against_transformers(hf, tl, pairs, timing: Timing) -> None:
    """TransformerLens' logits against transformers', the clean and corrupted metric, and one
    plain forward's time in each (after a warm-up)."""
    clean, corrupted, answers, distractors = pairs
    with torch.no_grad():
        tl(clean)  # warm-up
        t0 = time.perf_counter()
        tl_clean = tl(clean)
        timing["tl_forward_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        hf_clean = hf(clean).logits
        timing["hf_forward_s"] = time.perf_counter() - t0
        tl_corr = tl(corrupted)
        hf_corr = hf(corrupted).logits
    timing["tl_vs_hf_max_abs_logit_diff_clean"] = (tl_clean - hf_clean).abs().max().item()
    timing["tl_vs_hf_max_abs_logit_diff_corrupted"] = (tl_corr - hf_corr).abs().max().item()
    timing["max_abs_logit_clean"] = hf_clean.abs().max().item()
    timing["metric_clean_tl"] = metric(tl_clean[:, -1], answers, distractors).mean().item()
    timing["metric_clean_hf"] = metric(hf_clean[:, -1], answers, distractors).mean().item()
    timing["metric_corrupted_tl"] = metric(tl_corr[:, -1], answers, distractors).mean().item()


def patchable(tl, pairs, timing: Timing):
    """auto-circuit's loader (every prompt in one batch) and patchable model."""
    clean, corrupted, answers, distractors = pairs
    n_prompts, seq_len = clean.shape
    dataset = PromptDataset(list(clean), list(corrupted), [a.view(1) for a in answers], list(distractors))
    loader = PromptDataLoader(dataset, seq_len=seq_len, diverge_idx=0, batch_size=n_prompts, shuffle=False)
    t0 = time.perf_counter()
    model = patchable_model(tl, factorized=True, slice_output="last_seq", seq_len=None, separate_qkv=True,
                            device=torch.device("cpu"))
    timing["patchable_model_s"] = time.perf_counter() - t0
    timing["autocircuit_edges"] = len(model.edges)
    timing["autocircuit_src_nodes"] = len(model.srcs)
    timing["autocircuit_dest_nodes"] = len(model.dests)
    return model, loader


def eap_scores(model, loader, kv_group: int, skip_slow_eap: bool, timing: Timing):
    """EAP's scores (the reference EAP, or mask gradients at mask 0 with --skip-slow-eap), and the
    other beside it with their largest difference; each file written as soon as it is done."""
    def mask0():
        return mask_gradient_prune_scores(model, loader, None, grad_function="logit", answer_function="avg_diff",
                                          mask_val=0.0)
    mg0 = None
    if skip_slow_eap:
        eap = mg0 = timing.timed("mask_gradient_mask0", mask0)
        timing["eap_source"] = "mask_gradient_prune_scores(mask_val=0)"
    else:
        eap = timing.timed("eap", lambda: edge_attribution_patching_prune_scores(model, loader, None, answer_diff=True))
        timing["eap_source"] = "edge_attribution_patching_prune_scores"
        gc.collect()  # its run_with_cache caches (with autograd graphs) held ~11 GB at peak
    write_scores(timing.out / "autocircuit_eap.csv", scores_by_name(model, eap, kv_group))
    timing.save()
    if mg0 is None:
        mg0 = timing.timed("mask_gradient_mask0", mask0)
        timing["eap_vs_mask0_max_abs_diff"] = max((eap[k] - mg0[k]).abs().max().item() for k in eap)
        timing["max_abs_eap"] = max(eap[k].abs().max().item() for k in eap)
        write_scores(timing.out / "autocircuit_maskgrad0.csv", scores_by_name(model, mg0, kv_group))
        timing.save()
    return eap


def faithfulness_curve(model, loader, eap, answers, distractors, timing: Timing) -> None:
    """The metric when the top-n edges by |EAP| keep the clean run and the rest the corrupted one."""
    n_edges = len(model.edges)
    counts = sorted({n for n in (0, 10, 100, 1000, 10000) if n <= n_edges} | {n_edges})
    t0 = time.perf_counter()
    outs = run_circuits(model, loader, counts, eap, patch_type=PatchType.TREE_PATCH,
                        ablation_type=AblationType.RESAMPLE)
    timing["curve_s"] = time.perf_counter() - t0
    rows = []
    for kept, batch_outs in sorted(outs.items()):  # run_circuits keys by the circuit's edge count
        logits = torch.cat(list(batch_outs.values()))
        rows.append((kept, metric(logits, answers, distractors).mean().item()))
    rows.sort()
    (timing.out / "autocircuit_curve.csv").write_text("n,metric\n" + "".join(f"{n},{m!r}\n" for n, m in rows))
    print(rows, flush=True)


def main() -> None:
    args = arguments()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    timing = Timing(out, threads=args.threads, device="cpu", dtype="float32")
    pairs = read_pairs(args.inputs)
    _, _, answers, distractors = pairs

    t0 = time.perf_counter()
    hf, tl = load_models(args.model)
    timing["load_s"] = time.perf_counter() - t0
    kv_group = tl.cfg.n_heads // (tl.cfg.n_key_value_heads or tl.cfg.n_heads)
    check_against_transformers(hf, tl, pairs, timing)
    del hf
    print(dict(timing), flush=True)

    model, loader = patchable(tl, pairs, timing)
    eap = eap_scores(model, loader, kv_group, args.skip_slow_eap, timing)
    if not args.no_curve:
        faithfulness_curve(model, loader, eap, answers, distractors, timing)
        timing.save()
    if args.circuits:
        kept = json.loads(Path(args.circuits).read_text())
        timing["circuits"] = timing.timed("circuits", lambda: circuit_metrics(model, loader, kept, eap, kv_group,
                                                                              answers, distractors))
        timing.save()
    if args.ig_samples > 0:
        ig = timing.timed(f"mask_gradient_ig{args.ig_samples}", lambda: mask_gradient_prune_scores(
            model, loader, None, grad_function="logit", answer_function="avg_diff",
            integrated_grad_samples=args.ig_samples))
        write_scores(out / f"autocircuit_ig{args.ig_samples}.csv", scores_by_name(model, ig, kv_group))
        timing.save()
    timing.save()
    print(json.dumps(timing, indent=2))


if __name__ == "__main__":
    main()
