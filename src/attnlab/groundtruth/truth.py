"""The circuit a ground-truth model's task can show, derived from its program (docs/groundtruth.md,
"Circuits known by construction").

1. **Edges by construction.** Each operation of the read program is computed by known blocks
   (``attnlab_program.json``'s ``blocks``, read from the compiled weights): an Aggregate by one
   head, whose query reads its Select's queries, its key the Select's keys and its value the
   aggregated op; a SelectorWidth by a head (query and key as above) and the MLP after it, which
   reads that head; a Map or SequenceMap by one MLP reading its inputs; tokens and indices by the
   embeddings; the logits read the program's output. An edge of attnlab's graph is the sender
   computing an input, the receiver the block reading it in that role; one edge can carry
   several roles (an MLP reading two inputs from one sender).
2. **What same-length patching can see.** An edge is in the truth iff, for at least one clean /
   corrupted pair of the task, the program evaluated on the clean input with the roles the edge
   carries given the corrupted input's values (``Program.evaluate``'s interchange) changes the
   output at the read position (the last). Edges carrying what never changes between two inputs
   of one length (indices, length) or what the output ignores are dropped.
3. Heads and MLPs in the truth are those on its edges (a head by any of its q, k, v inputs or
   its output); the embeddings and logits are not components.
"""

from __future__ import annotations

from dataclasses import dataclass

from attnlab.groundtruth.program import Program

OUTPUT_ROLE = ("__output__", "logits")
TOLERANCE = 1e-9  # two numerical outputs differ by more than this


@dataclass(frozen=True)
class Truth:
    edges: frozenset[tuple[str, str]]  # (sender name, receiver name) as attnlab's edge graph names them
    heads: frozenset[tuple[int, int]]
    mlps: frozenset[int]
    candidates: frozenset[tuple[str, str]]  # every edge the program's structure has, seen or not


def _sender(block: dict, kind: str) -> str:
    if "embed" in block:
        return "embed"
    if kind == "selector_width":  # the value is the MLP's; the head writes its hidden count
        return f"L{block['mlp']}.MLP"
    if "head" in block:
        return f"L{block['head'][0]}.H{block['head'][1]}"
    return f"L{block['mlp']}.MLP"


def structural_edges(program: Program, blocks: dict[str, dict]) -> dict[tuple[str, str], list[tuple[str, str]]]:
    """(sender, receiver) -> the (operation, role) pairs it carries, for every input of every
    operation of the program (step 1 of the module docstring)."""
    edges: dict[tuple[str, str], list[tuple[str, str]]] = {}

    def add(source: str, receiver: str, role: tuple[str, str]) -> None:
        sender = _sender(blocks[source], program.ops[source]["kind"])
        edges.setdefault((sender, receiver), []).append(role)

    for label, op in program.ops.items():
        kind = op["kind"]
        if kind in ("aggregate", "selector_width"):
            layer, head = blocks[label]["head"]
            selector = program.ops[op["selector"]]
            add(selector["queries"], f"L{layer}.H{head}.q", (op["selector"], "queries"))
            add(selector["keys"], f"L{layer}.KV{head}.k", (op["selector"], "keys"))
            if kind == "aggregate":
                add(op["sop"], f"L{layer}.KV{head}.v", (label, "sop"))
            else:  # the head's count, read by its MLP
                edges.setdefault((f"L{layer}.H{head}", f"L{blocks[label]['mlp']}.MLP"), []).append((label, "selector"))
        elif kind in ("map", "sequence_map"):
            for role, source in program.roles(label).items():
                add(source, f"L{blocks[label]['mlp']}.MLP", (label, role))
    add(program.output, "logits", OUTPUT_ROLE)
    return edges


def _changes_output(program: Program, clean: dict, corrupted: dict, roles: list[tuple[str, str]], tokens: list) -> bool:
    if OUTPUT_ROLE in roles:
        read = corrupted[program.output][-1]
    else:
        patches = {}
        for operation, role in roles:
            patches[(operation, role)] = corrupted[program.roles(operation)[role]]
        read = program.evaluate(tokens, patches)[program.output][-1]
    return _differ(read, clean[program.output][-1])


def _differ(a, b) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return abs(a - b) > TOLERANCE
    return a != b


def derive(spec: dict, pairs: list[tuple[list, list]]) -> Truth:
    """The truth of the read program of ``spec`` (attnlab_program.json) on ``pairs`` of (clean,
    corrupted) tokens, BOS excluded."""
    read = spec["programs"][spec["readout"]]
    program = Program.of(read["program"])
    structure = structural_edges(program, read["blocks"])
    seen = set()
    for clean_tokens, corrupted_tokens in pairs:
        clean, corrupted = program.evaluate(clean_tokens), program.evaluate(corrupted_tokens)
        for edge, roles in structure.items():
            if edge not in seen and _changes_output(program, clean, corrupted, roles, clean_tokens):
                seen.add(edge)
    components = {_component(name) for edge in seen for name in edge} - {None}
    heads = {component[1:] for component in components if component[0] == "head"}
    mlps = {component[1] for component in components if component[0] == "mlp"}
    return Truth(frozenset(seen), frozenset(heads), frozenset(mlps), frozenset(structure))


def _component(name: str) -> tuple | None:
    """("head", layer, head), ("mlp", layer), or None for the embeddings and logits, from an edge
    graph name (L3.H0, L3.H0.q, L0.KV0.k, L2.MLP)."""
    if name in ("embed", "logits"):
        return None
    layer, part = name.split(".")[:2]
    if part == "MLP":
        return ("mlp", int(layer[1:]))
    return ("head", int(layer[1:]), int(part.lstrip("HKV")))
