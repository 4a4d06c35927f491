"""auto-circuit's ACDC and Subnetwork Probing circuits on a local Llama folder and a fixed batch of
IOI pairs, in attnlab's edge names, for ``benchmarks.peers.circuits`` (its docstring has the
comparison). Run it in .venv-autocircuit (``benchmarks/peers/autocircuit-requirements.txt``)::

    .venv-autocircuit/bin/python -m benchmarks.peers.circuits_worker \
        --model benchmarks/out/smollm2-135m-2layers --inputs benchmarks/out/edge_peers/circuits_inputs.json \
        --request benchmarks/out/edge_peers/circuits_request.json --out benchmarks/out/edge_peers \
        --tau-base 1 --tau-exp -5 --sp-epochs 200 --sp-lambda 0.01

The model, the patchable model (one batch of every prompt, patching over all positions at once),
the metric and the name mapping are ``edges_worker``'s. auto-circuit and TransformerLens are
imported inside the functions (``edges_worker`` shims TransformerLens on import), so that the
main virtualenv imports this module too (tests/test_benchmark_scripts.py).

- ACDC: ``acdc_prune_scores(tao_bases=[base], tao_exps=[exp], faithfulness_target="kl_div")``,
  one τ; its circuit is the edges never removed (prune score +inf). It visits the edges sorted by
  the receiver's layer, within a layer in the order of ``model.edges``, a set whose order changes
  from process to process (``acdc_circuit``). ``--acdc-orders attnlab`` also runs it on the same
  edges handed over in attnlab's visiting order (``visiting_key``): the algorithms side by side
  with the order taken out.
- SP: ``subnetwork_probing_prune_scores(tree_optimisation=True, faithfulness_target="kl_div",
  mask_fn="hard_concrete", circuit_size=request's sp_circuit_size, epochs=--sp-epochs,
  regularize_lambda=--sp-lambda)`` with its other defaults (lr 0.1, the masks' initial value),
  torch seeded first. ``--sp-variants``: ``mean`` runs it as shipped (removed edges take the
  token-wise mean of the corrupted prompts); ``resample`` with
  ``subnetwork_probing.batch_src_ablations`` replaced for the call by the per-prompt corrupted
  activations (``AblationType.RESAMPLE``), the ablation of ACDC and of attnlab. Its circuit in
  attnlab's names: an attnlab edge's score is the largest of its copies' (an attnlab key/value
  edge has one copy per query head of its group), and the circuit is the top ``sp_top_k``
  attnlab edges; its own reading, the top ``sp_circuit_size`` of its edges, is evaluated too.
  auto-circuit 1.0.1's SP builds its optimiser as ``t.optim.adam.Adam``, a name torch 2.13 deletes
  from ``torch.optim`` after importing it: the worker puts the module back before the call.
- Evaluations (``run_circuits``, tree patching, resample ablation: the clean input, every edge
  not in the circuit carrying its sender's corrupted-prompt activation): auto-circuit's ACDC
  circuits as found (copies as kept), SP's top k attnlab edges with every copy and its own top
  ``sp_circuit_size`` edges, and attnlab's circuits of the request with every copy of their
  key/value edges. Each: the mean metric, the explained effect against TransformerLens' clean and
  corrupted metrics, and KL(clean ‖ circuit) at the last position (``multibatch_kl_div``).

Writes ``autocircuit_circuits.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import math
import time
from pathlib import Path

import torch


def ac_names(edges, kv_group: int) -> list[list[str]]:
    """auto-circuit edges → the sorted attnlab (sender, receiver) names they map onto."""
    from benchmarks.peers.edges_worker import attnlab_names

    return sorted(map(list, {attnlab_names(edge, kv_group) for edge in edges}))


def expand(model, names, kv_group: int) -> set:
    """Every auto-circuit edge (all copies) of attnlab's edges ``names``."""
    from benchmarks.peers.edges_worker import attnlab_names

    wanted = {tuple(name) for name in names}
    return {edge for edge in model.edges if attnlab_names(edge, kv_group) in wanted}


def evaluate(model, loader, chosen: set, reference: dict) -> dict:
    """The circuit keeping the auto-circuit edges ``chosen`` by ``run_circuits`` (module docstring)."""
    from auto_circuit.prune import run_circuits
    from auto_circuit.types import AblationType, PatchType
    from auto_circuit.utils.tensor_ops import multibatch_kl_div
    from benchmarks.peers.edges_worker import metric

    scores = model.new_prune_scores()
    for edge in chosen:
        scores[edge.dest.module_name][edge.patch_idx] = 1.0
    count = len(chosen)
    outs = run_circuits(model, loader, [count], scores, patch_type=PatchType.TREE_PATCH,
                        ablation_type=AblationType.RESAMPLE)
    logits = torch.cat(list(outs[count].values()))
    value = metric(logits, reference["answers"], reference["distractors"]).mean().item()
    kl = multibatch_kl_div(torch.log_softmax(logits, -1), reference["clean_logprobs"]).item()
    return {"autocircuit_edges": count, "metric": value, "kl": kl,
            "explained_effect": (value - reference["corrupted"]) / (reference["clean"] - reference["corrupted"])}


def visiting_key(src: str, dest: str, kv_group: int) -> tuple:
    """Where attnlab's ACDC visits an auto-circuit edge (by its node names): receivers from the
    logits back (a layer's MLP, its value heads, key heads, query heads, each from the last),
    the copies of a key/value receiver from the last query head, and each receiver's senders from
    the latest to the embeddings. Sorted ascending, the edges come in that order."""
    if dest == "Resid End":
        receiver = (0,)
    elif dest.startswith("MLP "):
        receiver = (1, -int(dest.split()[1]), 0)
    else:  # A{l}.{h}.{Q|K|V}
        layer, head, letter = dest[1:].split(".")
        kind = {"V": 1, "K": 2, "Q": 3}[letter]
        receiver = (1, -int(layer), kind, -(int(head) // kv_group), -int(head))
    if src == "Resid Start":
        sender = (1,)
    elif src.startswith("MLP "):
        sender = (0, -int(src.split()[1]), 0)
    else:  # A{l}.{h}
        layer, head = src[1:].split(".")
        sender = (0, -int(layer), 1, -int(head))
    return receiver, sender


def acdc_circuit(model, loader, base: int, exp: int, kv_group: int, order: str) -> tuple[dict, set]:
    """auto-circuit's ACDC at τ = base × 10^exp: the result and its circuit (auto-circuit edges).
    ``order``: ``shipped`` leaves ``model.edges`` (a set) as it is, so the edges of a layer come
    in the set's order, which changes from process to process (hash(None) is an address in
    Python 3.11: PYTHONHASHSEED does not fix it); ``attnlab`` hands ACDC the edges in attnlab's
    visiting order (``visiting_key``), which its stable sort by layer keeps."""
    from auto_circuit.prune_algos.ACDC import acdc_prune_scores

    shipped = model.edges
    if order == "attnlab":  # a list: ACDC only iterates model.edges (into its sorted OrderedSet)
        model.edges = sorted(shipped, key=lambda e: visiting_key(e.src.name, e.dest.name, kv_group))
    visited = [edge.name for edge in sorted(model.edges, key=lambda edge: edge.dest.layer, reverse=True)]
    started = time.perf_counter()
    try:
        scores = acdc_prune_scores(model, loader, None, tao_exps=[exp], tao_bases=[base],
                                   faithfulness_target="kl_div")
    finally:
        model.edges = shipped
    seconds = time.perf_counter() - started
    kept = {edge for edge in model.edges if math.isinf(float(scores[edge.dest.module_name][edge.patch_idx]))}
    return {"edges": ac_names(kept, kv_group), "autocircuit_edges": len(kept), "seconds": seconds,
            "tau": base * 10.0 ** exp, "forwards": len(model.edges), "order": order,
            "first_visited": visited[:5], "order_md5": hashlib.md5("|".join(visited).encode()).hexdigest()}, kept


def sp_scores(model, loader, epochs: int, size: int, resample: bool, seed: int, regularize: float
              ) -> tuple[dict, float]:
    """SP's prune scores (module docstring) and its seconds."""
    import auto_circuit.prune_algos.subnetwork_probing as sp
    from auto_circuit.types import AblationType

    # SP calls t.optim.adam.Adam: torch 2.13 deletes the name ``adam`` from torch.optim (module docstring)
    torch.optim.adam = importlib.import_module("torch.optim.adam")
    shipped = sp.batch_src_ablations
    if resample:
        sp.batch_src_ablations = lambda m, dl, ablation_type=None, clean_corrupt=None: shipped(
            m, dl, AblationType.RESAMPLE, "corrupt")
    torch.manual_seed(seed)
    started = time.perf_counter()
    try:
        scores = sp.subnetwork_probing_prune_scores(
            model, loader, None, learning_rate=0.1, epochs=epochs, regularize_lambda=regularize,
            mask_fn="hard_concrete", circuit_size=size, tree_optimisation=True, faithfulness_target="kl_div")
    finally:
        sp.batch_src_ablations = shipped
    return scores, time.perf_counter() - started


def sp_circuit(model, loader, request: dict, resample: bool, args, kv_group: int) -> tuple[dict, set, set]:
    """SP's result, its circuit in attnlab's names (top k, as auto-circuit edges with every copy)
    and its own reading (its top ``sp_circuit_size`` edges)."""
    from benchmarks.peers.edges_worker import attnlab_names

    size, k = request["sp_circuit_size"], request["sp_top_k"]
    scores, seconds = sp_scores(model, loader, args.sp_epochs, size, resample, args.seed, args.sp_lambda)
    edges = sorted(model.edges, key=lambda edge: edge.name)  # ties broken by name, not by hash order
    value = {edge: float(scores[edge.dest.module_name][edge.patch_idx]) for edge in edges}
    own = set(sorted(edges, key=lambda edge: -value[edge])[:size])
    best: dict[tuple[str, str], float] = {}
    for edge in edges:
        name = attnlab_names(edge, kv_group)
        best[name] = max(best.get(name, -math.inf), value[edge])
    top = sorted(best, key=lambda name: -best[name])[:k]
    return ({"edges": [list(name) for name in top], "autocircuit_edges": len(expand(model, top, kv_group)),
             "seconds": seconds, "epochs": args.sp_epochs, "circuit_size": size, "regularize_lambda": args.sp_lambda,
             "own_reading_edges": len(own), "own_reading_in_attnlab_names": len(ac_names(own, kv_group)),
             "ablation": "resample (per-prompt corrupted)" if resample else "token-wise mean of the corrupted prompts"},
            expand(model, top, kv_group), own)


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--inputs", required=True)
    parser.add_argument("--request", required=True, help="JSON: circuits (attnlab's names), sp_circuit_size, sp_top_k")
    parser.add_argument("--out", required=True)
    parser.add_argument("--tau-base", type=int, required=True)
    parser.add_argument("--tau-exp", type=int, required=True)
    parser.add_argument("--acdc-orders", nargs="+", default=["shipped"], choices=["shipped", "attnlab"])
    parser.add_argument("--sp-epochs", type=int, default=300)
    parser.add_argument("--sp-lambda", type=float, default=10.0, help="SP's regularize_lambda (its default 10)")
    parser.add_argument("--sp-variants", nargs="+", default=["resample"], choices=["resample", "mean"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    return parser.parse_args()


def main() -> None:
    args = arguments()
    torch.set_num_threads(args.threads)
    from benchmarks.peers import edges_worker as ew  # imports auto-circuit, TransformerLens shimmed

    out, request = Path(args.out), json.loads(Path(args.request).read_text())
    pairs = ew.read_pairs(args.inputs)
    hf, tl = ew.load_models(args.model)
    kv_group = tl.cfg.n_heads // (tl.cfg.n_key_value_heads or tl.cfg.n_heads)
    checks: dict = {}
    ew.check_against_transformers(hf, tl, pairs, checks)
    del hf
    model, loader = ew.patchable(tl, pairs, checks)
    with torch.no_grad():
        clean_logits = tl(pairs[0])[:, -1]
    reference = {"answers": pairs[2], "distractors": pairs[3], "clean_logprobs": torch.log_softmax(clean_logits, -1),
                 "clean": checks["metric_clean_tl"], "corrupted": checks["metric_corrupted_tl"]}
    result = {"autocircuit_graph_edges": len(model.edges), "kv_group": kv_group, "checks": checks}
    circuits = {}
    for order in args.acdc_orders:
        name = "acdc" if order == "shipped" else f"acdc_{order}_order"
        result[name], circuits[f"autocircuit_{name}"] = acdc_circuit(model, loader, args.tau_base, args.tau_exp,
                                                                     kv_group, order)
        print(name, result[name]["autocircuit_edges"], result[name]["seconds"], flush=True)
    for variant in args.sp_variants:
        result[f"sp_{variant}"], circuits[f"autocircuit_sp_{variant}"], own = sp_circuit(
            model, loader, request, variant == "resample", args, kv_group)
        circuits[f"autocircuit_sp_{variant}_own_reading"] = own
        print(variant, result[f"sp_{variant}"]["seconds"], flush=True)
    circuits.update({name: expand(model, edges, kv_group) for name, edges in request["circuits"].items()})
    result["evaluations"] = {name: evaluate(model, loader, chosen, reference) for name, chosen in circuits.items()}
    (out / "autocircuit_circuits.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result["evaluations"], indent=2), flush=True)


if __name__ == "__main__":
    main()
