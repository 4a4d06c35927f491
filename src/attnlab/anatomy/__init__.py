"""One place that knows each model family's parts (blocks, attention projections, norms and their
places, the MLP and its activation, embeddings, positions, dropout fields): ``families`` as data,
importable without torch; ``parts`` finds them in a loaded model (``anatomy.of(model)``);
``norms`` reads what a norm computes. No other module of attnlab names a model's submodule
(tests/test_anatomy.py holds that).

Importing this package imports no torch (Snakemake's parse reads ``families``); the names of
``parts`` and ``norms`` load on first use."""

import importlib

from attnlab.anatomy.families import FAMILIES, STAGES, Family, UnknownFamily, config_shape, family_of

_LAZY = {"Anatomy": "parts", "Slot": "parts", "of": "parts", "linear_weight": "parts", "in_features": "parts",
         "out_features": "parts", "heads_in": "parts", "heads_out": "parts", "NormSpec": "norms", "norm_spec": "norms", "at_least_float32": "norms"}

__all__ = ["FAMILIES", "STAGES", "Family", "UnknownFamily", "config_shape", "family_of", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"attnlab.anatomy.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'attnlab.anatomy' has no attribute {name!r}")
