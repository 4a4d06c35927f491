"""Region-aligned views of the extracted attention, head rankings and λ tables.

Within one condition every prompt has the same prefix (template + system
prompt) and the same inserted run, so positions line up across prompts until
the question starts; questions differ in length, so means are taken over the
prompts that still have a token at each position (shown only where at least
``min_share`` of them do).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from attnlab.config.checks import check_heads
from attnlab.extraction.h5format import open_attention
from attnlab.reasoning.grading import bootstrap_cis

INSERTED, QUESTION, CUT = 1, 2, 3  # indices in /spans (attnlab.reasoning.prompts.SPANS)


def question_mask(spans: np.ndarray, width: int) -> np.ndarray:
    """[prompts, width]: the question's own tokens (an insertion inside it excluded)."""
    mask = np.zeros((len(spans), width), bool)
    for row, span in enumerate(spans):
        mask[row, slice(*span[QUESTION])] = True
        mask[row, slice(*span[INSERTED])] = False
    return mask


def inserted_share(spans: np.ndarray, width: int) -> np.ndarray:
    """[width]: the share of prompts whose inserted run covers each position.

    1 on a run every prompt has at the same place (a fixed prefix before it); between
    0 and 1 where the run's place varies by prompt (question_random, end)."""
    covered = np.zeros((len(spans), width), bool)
    for row, span in enumerate(spans):
        covered[row, slice(*span[INSERTED])] = True
    return covered.mean(0) if len(spans) else np.zeros(width)


def runs_of(flags: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of True in a 1-d boolean array."""
    edges = np.diff(np.r_[0, flags.astype(np.int8), 0])
    return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()))


def read_head(path, layer: int, head: int, name: str = "received", key: str = "attention.heads") -> dict:
    """One head across all prompts (a single chunk read), with spans and lengths; ``key`` is
    where the head is configured, for the message when it is out of range."""
    with open_attention(path) as h5:
        check_heads([{"layer": layer, "head": head}], int(h5.attrs["n_layers"]),
                    int(h5.attrs["n_heads"]), str(h5.attrs.get("model", path)), key)
        return {"values": h5[f"{name}/layer_{layer:02d}"][head], "spans": h5["spans"][:],
                "lengths": h5["lengths"][:], "ids": h5["ids"].asstr()[:]}


def align(values: np.ndarray, spans: np.ndarray, lengths: np.ndarray, remove_inserted: bool) -> np.ndarray:
    """[prompts, positions], NaN padded; with ``remove_inserted`` the inserted run and its
    separator are cut out, so the remaining tokens are those of the prompt without
    insertion (wherever the insertion was placed)."""
    rows = []
    for row, (length, span) in enumerate(zip(lengths, spans)):
        start, end = span[CUT]
        kept = np.r_[0:start, end:length] if remove_inserted else np.arange(length)
        rows.append(values[row, kept])
    width = max(len(r) for r in rows)
    out = np.full((len(rows), width), np.nan, np.float32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


# The band of the attention figures: a percentile bootstrap over prompts at each position,
# seeded, with grading.bootstrap_ci (the accuracy figures' interval). Its ends are means of
# resampled values, so a quantity in [0, 1] keeps its band in [0, 1]; a normal or t interval
# dips below 0 with few prompts (-0.03 at n = 6).
BAND_CONFIDENCE = 0.95
BAND_RESAMPLES = 1000
BAND_SEED = 0


def mean_and_band(aligned: np.ndarray, min_share: float = 0.5) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean over prompts and the low and high ends of its 95% percentile-bootstrap interval
    at each position (over the prompts that have a token there; no width where one prompt),
    for the positions that at least ``min_share`` of the prompts reach."""
    present = np.isfinite(aligned)
    count = present.sum(0)
    keep = count >= max(1, min_share * len(aligned))
    width = int(np.max(np.nonzero(keep)[0]) + 1) if keep.any() else 0
    mean = np.full(width, np.nan)
    low, high = np.full(width, np.nan), np.full(width, np.nan)
    # Positions held by the same prompts are bootstrapped together (one call of a few hundred
    # positions instead of one call each: 0.17 s -> 0.01 s per head and condition of a figure
    # here), each position's interval as its own call would give it.
    patterns, group = np.unique(present[:, :width].T, axis=0, return_inverse=True)
    for pattern, holders in enumerate(patterns):
        if not holders.any():
            continue
        positions = np.flatnonzero(group.reshape(-1) == pattern)
        values = aligned[np.ix_(holders, positions)].astype(float).T  # [positions, prompts]
        mean[positions] = [row.mean() for row in values]  # each as a 1-D mean sums it, to the bit
        low[positions], high[positions] = bootstrap_cis(values, BAND_CONFIDENCE, BAND_RESAMPLES, BAND_SEED)
    return mean, low, high


def head_change_scores(path_a, path_b, drop_first: bool = True) -> pd.DataFrame:
    """Per head: mean |received_a − received_b| over aligned, non-inserted positions."""
    with open_attention(path_a) as a, open_attention(path_b) as b:
        if list(a["ids"].asstr()[:]) != list(b["ids"].asstr()[:]):
            raise ValueError(f"{path_a} and {path_b} hold different prompts")
        rows = []
        spans_a, spans_b = a["spans"][:], b["spans"][:]
        lengths_a, lengths_b = a["lengths"][:], b["lengths"][:]
        for layer in range(int(a.attrs["n_layers"])):
            ra, rb = a[f"received/layer_{layer:02d}"][:], b[f"received/layer_{layer:02d}"][:]
            for head in range(ra.shape[0]):
                xa = align(ra[head], spans_a, lengths_a, remove_inserted=True)
                xb = align(rb[head], spans_b, lengths_b, remove_inserted=True)
                width = min(xa.shape[1], xb.shape[1])
                diff = np.abs(xa[:, :width] - xb[:, :width])[:, int(drop_first):]
                rows.append({"layer": layer, "head": head, "score": float(np.nanmean(diff))})
    return pd.DataFrame(rows).sort_values("score", ascending=False, kind="stable").reset_index(drop=True)


def lambda_table(paths: dict[str, str]) -> pd.DataFrame:
    """Mean λ over question-token queries, per condition × layer × head."""
    rows = []
    for condition, path in paths.items():
        with open_attention(path) as h5:
            spans, lengths = h5["spans"][:], h5["lengths"][:]
            question = question_mask(spans, int(lengths.max()))
            for layer in range(int(h5.attrs["n_layers"])):
                lam = h5[f"lam/layer_{layer:02d}"][:]  # [H, N, T]
                for head in range(lam.shape[0]):
                    values = lam[head][:, : question.shape[1]][question]
                    rows.append({"condition": condition, "layer": layer, "head": head,
                                 "lambda_mean": float(values.mean()),
                                 "lambda_min": float(values.min())})
    return pd.DataFrame(rows)
