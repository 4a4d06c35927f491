"""tracr's side (an optional extra: ``pip install tracr-pypi``; jax and haiku come with it): compile
RASP programs causally and keep what attnlab needs of each, as plain data:

- the assembled weights (numpy) and the labels of the residual directions (``op:value``, or ``op``
  for a numerical op, ``one``);
- the program serialized as tables over the value sets tracr inferred (``program.Program``);
- the block that computes each operation, read from the weights: an Aggregate is the head writing
  its directions, a Map or SequenceMap the MLP writing them, a SelectorWidth a head (writing its
  ``_selector_width_attn_output``) and the MLP after it;
- tracr's own outputs (the final residual at the output directions) on every input.

Nothing here is imported by the workflow: the converted models are committed (data/groundtruth).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

VOCAB = ("a", "b", "c")
MAX_LEN = 5  # real tokens; BOS comes first
BOS = "BOS"
EPSILON = 1e-9  # a weight smaller than this reads or writes nothing


def _programs(lib, rasp) -> dict:
    return {
        "reverse": lambda: lib.make_reverse(rasp.tokens),
        "frac_prevs": lambda: lib.make_frac_prevs(rasp.tokens == "a"),
        "hist": lambda: lib.make_hist(),
    }


PROGRAMS = ("reverse", "frac_prevs", "hist")


@dataclass
class Compiled:
    """One compiled program, as plain data (see the module docstring)."""

    name: str
    params: dict[str, np.ndarray]  # "layer_0/attn/query/w", "token_embed", "pos_embed", ...
    labels: list[str]
    n_layers: int
    heads: int
    key_size: int
    mlp_hidden: int
    token_ids: dict[str, int]  # tracr's input encoding (BOS and pad included)
    output_labels: list[str]  # the directions tracr unembeds, in its output order
    output_values: list  # the value each output direction stands for (numerical: [None])
    program: dict  # program.Program's serialized form
    blocks: dict[str, dict]  # op -> {"head": [layer, head]} and/or {"mlp": layer}; "embed" for inputs
    reference: dict  # {"inputs": [[token, ...]], "outputs": [T x outputs per input]}
    evaluations: dict = field(default_factory=dict)  # op -> its values on each reference input (tracr's causal evaluator)


def compile_program(name: str) -> Compiled:
    from tracr.compiler import basis_inference, compiling, lib, nodes, rasp_to_graph
    from tracr.rasp import rasp

    program = _programs(lib, rasp)[name]()
    model = compiling.compile_rasp_to_model(program, vocab=set(VOCAB), max_seq_len=MAX_LEN,
                                            compiler_bos=BOS, causal=True)
    extracted = rasp_to_graph.extract_rasp_graph(program)  # the same graph compile built, with value sets
    basis_inference.infer_bases(extracted.graph, extracted.sink, set(VOCAB), MAX_LEN)
    config = model.model_config
    params = {f"{module.removeprefix('transformer/')}/{key}": np.asarray(value, dtype=np.float64)
              for module, values in model.params.items() for key, value in values.items()}
    params = {key.replace("token_embed/embeddings", "token_embed").replace("pos_embed/embeddings", "pos_embed"): value
              for key, value in params.items()}
    labels = list(model.residual_labels)
    sink = extracted.sink[nodes.ID]
    numerical = rasp.is_numerical(program)
    if numerical:
        output_labels, output_values = [sink], [None]
    else:
        ordered = sorted(model.output_encoder.encoding_map.items(), key=lambda item: item[1])
        output_values = [value for value, _ in ordered]
        output_labels = [f"{sink}:{value}" for value in output_values]
    compiled = Compiled(name, params, labels, config.num_layers, config.num_heads, config.key_size,
                        config.mlp_hidden_size, dict(model.input_encoder.encoding_map), output_labels,
                        output_values, serialize(extracted.graph, sink, rasp, nodes), {}, {})
    compiled.blocks = blocks_of(compiled)
    compiled.reference = reference_outputs(model, compiled)
    compiled.evaluations = causal_values(extracted.graph, compiled, nodes)
    return compiled


def causal_values(graph, compiled: Compiled, nodes) -> dict[str, list]:
    """tracr's causal evaluation of every operation but the selectors on every reference input:
    what tests hold the serialized program's evaluator to."""
    from tracr.rasp import causal_eval

    return {label: [[_plain(v) for v in causal_eval.evaluate(graph.nodes[label][nodes.EXPR], tokens)]
                    for tokens in compiled.reference["inputs"]]
            for label, op in compiled.program["ops"].items() if op["kind"] != "select"}


def serialize(graph, sink: str, rasp, nodes) -> dict:
    """Every operation of the program as data: its kind, its inputs by role, and its function as a
    table over the value sets of its inputs (JSON values: str, int, float, bool, None)."""
    values = {label: sorted(node.get(nodes.VALUE_SET, ()), key=repr) for label, node in graph.nodes.items()}
    ops = {}
    for label, node in graph.nodes.items():
        expr = node[nodes.EXPR]
        if isinstance(expr, rasp.TokensType):
            ops[label] = {"kind": "tokens"}
        elif isinstance(expr, rasp.IndicesType):
            ops[label] = {"kind": "indices"}
        elif isinstance(expr, rasp.Map):
            ops[label] = {"kind": "map", "inner": expr.inner.label,
                          "table": [[x, _plain(expr.f(x))] for x in values[expr.inner.label]]}
        elif isinstance(expr, rasp.SequenceMap):
            first, second = expr.fst.label, expr.snd.label
            ops[label] = {"kind": "sequence_map", "fst": first, "snd": second,
                          "table": [[x, y, _plain(expr.f(x, y))] for x, y in itertools.product(values[first], values[second])]}
        elif isinstance(expr, rasp.Select):
            keys, queries = expr.keys.label, expr.queries.label
            ops[label] = {"kind": "select", "keys": keys, "queries": queries,
                          "table": [[k, q, bool(expr.predicate(k, q))] for k, q in itertools.product(values[keys], values[queries])]}
        elif isinstance(expr, rasp.Aggregate):
            ops[label] = {"kind": "aggregate", "selector": expr.selector.label, "sop": expr.sop.label,
                          "numerical": bool(rasp.is_numerical(expr)), "default": _plain(expr.default)}
        elif isinstance(expr, rasp.SelectorWidth):
            ops[label] = {"kind": "selector_width", "selector": expr.selector.label}
        else:
            raise NotImplementedError(f"operation {label} ({type(expr).__name__}) is not serialized")
        if label in values and nodes.VALUE_SET in node:
            ops[label]["values"] = [_plain(v) for v in values[label]]
    return {"ops": ops, "output": sink}


def _plain(value):
    """A JSON value for a table entry (numpy scalars to Python's)."""
    return value.item() if isinstance(value, np.generic) else value


def _written(weights: np.ndarray, labels: list[str]) -> set[str]:
    """The ops whose directions the columns of ``weights`` (inputs x residual) write."""
    return {labels[i].split(":", 1)[0] for i in np.nonzero(np.abs(weights).sum(0) > EPSILON)[0]}


def blocks_of(compiled: Compiled) -> dict[str, dict]:
    """The block computing each operation, from which block writes its directions."""
    writers: dict[str, dict] = {}
    size = compiled.key_size
    for layer in range(compiled.n_layers):
        out = compiled.params[f"layer_{layer}/attn/linear/w"]
        for head in range(compiled.heads):
            for op in _written(out[head * size:(head + 1) * size], compiled.labels):
                writers.setdefault(op, {})["head"] = [layer, head]
        for op in _written(compiled.params[f"layer_{layer}/mlp/linear_2/w"], compiled.labels):
            writers.setdefault(op, {}).setdefault("mlp", layer)
    blocks = {}
    for label, op in compiled.program["ops"].items():
        kind = op["kind"]
        if kind in ("tokens", "indices"):
            blocks[label] = {"embed": True}
        elif kind == "aggregate":
            blocks[label] = {"head": writers[label]["head"]}
        elif kind in ("map", "sequence_map"):
            blocks[label] = {"mlp": writers[label]["mlp"]}
        elif kind == "selector_width":
            blocks[label] = {"head": writers[f"{label}_selector_width_attn_output"]["head"],
                             "mlp": writers[label]["mlp"]}
    return blocks


def reference_outputs(model, compiled: Compiled) -> dict:
    """tracr's final residual at the output directions, for every input of MAX_LEN tokens."""
    import jax.numpy as jnp

    inputs = [list(tokens) for tokens in itertools.product(VOCAB, repeat=MAX_LEN)]
    encoded = jnp.array([[compiled.token_ids[BOS]] + [compiled.token_ids[t] for t in tokens] for tokens in inputs])
    final = np.asarray(model.forward(model.params, encoded).transformer_output.output, dtype=np.float64)
    columns = [compiled.labels.index(label) for label in compiled.output_labels]
    return {"inputs": inputs, "outputs": final[:, :, columns].tolist()}
