"""A RASP program serialized by ``compiled.serialize``, evaluated as the causally compiled model
computes it, with interchange interventions.

Semantics are tracr's causal evaluator's (``tracr.rasp.causal_eval``): tokens and indices count
from the first token after BOS; a Select's matrix is the predicate of (key, query) masked to keys
at or before the query; an Aggregate takes the mean of the selected values (one selected: that
value; none: its default); a SelectorWidth counts the selected keys. Every function is the table
serialized from the program's own, over the value sets tracr inferred.

An interchange replaces what one operation reads in one role (``Map``: inner; ``SequenceMap``:
fst, snd; ``Select``: keys, queries; ``Aggregate``: selector, sop; ``SelectorWidth``: selector)
by given values (those of another input), everything else computed as usual: the program-level
counterpart of patching one edge.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

ROLES = {"map": ("inner",), "sequence_map": ("fst", "snd"), "select": ("keys", "queries"),
         "aggregate": ("selector", "sop"), "selector_width": ("selector",), "tokens": (), "indices": ()}


def _key(*values) -> str:
    return json.dumps(values)


@dataclass
class Program:
    ops: dict[str, dict]
    output: str
    _tables: dict[str, dict] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, serialized: dict) -> "Program":
        program = cls(serialized["ops"], serialized["output"])
        for label, op in program.ops.items():
            if "table" in op:  # inputs -> output, keyed by the inputs' JSON
                program._tables[label] = {_key(*row[:-1]): row[-1] for row in op["table"]}
        return program

    def roles(self, label: str) -> dict[str, str]:
        """The operations ``label`` reads, by role."""
        op = self.ops[label]
        return {role: op[role] for role in ROLES[op["kind"]]}

    def evaluate(self, tokens: list, patches: dict[tuple[str, str], list] | None = None) -> dict[str, list]:
        """Every operation's values on ``tokens`` (no BOS); ``patches``: (operation, role) -> the
        values that operation reads in that role instead of its input's."""
        patches = patches or {}
        values: dict[str, list] = {}

        def value(label: str):
            if label not in values:
                inputs = {role: patches.get((label, role)) for role in ROLES[self.ops[label]["kind"]]}
                inputs = {role: given if given is not None else value(self.roles(label)[role])
                          for role, given in inputs.items()}
                values[label] = self._apply(label, tokens, inputs)
            return values[label]

        for label in self.ops:
            value(label)
        return values

    def _apply(self, label: str, tokens: list, inputs: dict) -> list:
        op, table = self.ops[label], self._tables.get(label)
        kind = op["kind"]
        if kind == "tokens":
            return list(tokens)
        if kind == "indices":
            return list(range(len(tokens)))
        if kind == "map":
            return [None if x is None else table[_key(x)] for x in inputs["inner"]]
        if kind == "sequence_map":
            return [None if None in (x, y) else table[_key(x, y)] for x, y in zip(inputs["fst"], inputs["snd"])]
        if kind == "select":  # [query][key], causal
            return [[k <= q and table[_key(key, query)] for k, key in enumerate(inputs["keys"])]
                    for q, query in enumerate(inputs["queries"])]
        if kind == "selector_width":
            return [sum(row) for row in inputs["selector"]]
        return [_mean([v for chosen, v in zip(row, inputs["sop"]) if chosen], op["default"]) for row in inputs["selector"]]


def _mean(selected: list, default):
    """tracr's aggregate: the default for none, the value for one, the mean of numbers."""
    if not selected:
        return default
    if len(selected) == 1:
        return selected[0]
    return sum(selected) / len(selected)
