"""The patching engine: a task's clean and corrupted prompts as token batches with their metric
(``tasks``, ``batch``), exact and attribution patching of heads in resumed passes (``heads``:
``Patcher``; mean ablation's reference as a file: ``mean_reference``) and of edges between
components (``edges``: ``EdgeCircuits``, EAP and EAP-IG). The head and edge sweeps, the counts,
mediation and the ground-truth scoring are its users (rules score_heads, sweep_heads,
edge_circuit, mediate, groundtruth_score).
"""
