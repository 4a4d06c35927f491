"""Circuits known by construction: RASP programs compiled by tracr into GPT-2 models whose true
circuit is derived from the program, to score every circuit method against (``make groundtruth``).

- ``compiled`` (needs tracr and jax, an optional extra): compile the programs, serialize each as
  tables, record which block writes each operation and tracr's own outputs;
- ``convert``: one or several compiled programs side by side as an unmodified ``GPT2LMHeadModel``
  folder (exact: LayerNorm reduced to x - mean), a word-level tokenizer with BOS and the spec;
- ``program``: the serialized program's evaluator, with interchange interventions;
- ``truth``: the circuit that same-length clean/corrupted patching can see, derived from the
  program and its blocks (docs/groundtruth.md, "Circuits known by construction");
- ``pairs``: the tasks ``program`` and ``program_control`` of attnlab's task system;
- ``scoring``: precision, recall and ROC AUC of each method against the truth.

Used by the rules of workflow/rules/groundtruth.smk; the models are committed under
data/groundtruth/ (``make groundtruth-models`` rebuilds them).
"""
