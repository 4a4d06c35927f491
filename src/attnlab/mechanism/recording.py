"""Running prompts through a model to record one layer's MLP activation (``mlp.ActivationRecorder``
inside ``interventions.intervened``): above the intervention context, which ``mlp`` sits below."""

from __future__ import annotations

import contextlib

import numpy as np
import pandas as pd
import torch

from attnlab import anatomy
from attnlab.interventions import intervened
from attnlab.interventions.mlp import ActivationRecorder, LayerRecorded
from attnlab.models import left_pad, padded_span_mask


def record_activations(model, prompts: pd.DataFrame, layer: int, threshold: float,
                       edges: np.ndarray, batch_size: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per-prompt statistics and the histogram of ``a`` over each prompt's question tokens
    (an insertion inside the question excluded). Each forward stops at the recorded layer's
    activation (``LayerRecorded``): nothing after it in a causal model can change it."""
    recorder = ActivationRecorder(layer, threshold, edges, stop_forward=True)
    base = anatomy.of(model).decoder
    device = next(model.parameters()).device
    with intervened(model, activations=recorder):
        for start in range(0, len(prompts), batch_size):
            batch = prompts.iloc[start:start + batch_size]
            rows = [np.asarray(ids).tolist() for ids in batch["input_ids"]]
            lengths = [len(r) for r in rows]
            ids, mask, positions = left_pad(rows)
            width = ids.shape[1]
            question = padded_span_mask(lengths, batch[["question_start", "question_end"]].to_numpy(), width)
            inserted = padded_span_mask(lengths, batch[["inserted_start", "inserted_end"]].to_numpy(), width)
            recorder.mask = question & ~inserted
            with torch.inference_mode(), contextlib.suppress(LayerRecorded):
                base(input_ids=ids.to(device), attention_mask=mask.to(device),
                     position_ids=positions.to(device), use_cache=False)
                raise RuntimeError(f"the forward ran past layer {layer}'s MLP activation without "
                                   "recording it: the recorder's hook is not on that layer's act_fn")
    return recorder.table(), recorder.histogram()
