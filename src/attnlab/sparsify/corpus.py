"""The post-training corpus: for each source of the configured mixture, held-out, calibration and
training sequences from disjoint documents, so neither a reported number nor the calibration
ever sees trained text; training draws each sequence's source at its weight."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from attnlab.config.corpus import Source, corpus_sources, shares
from attnlab.sparsify.errors import SparsifyError
from attnlab.sparsify.sources import source_documents

log = logging.getLogger(__name__)


def corpus_documents(corpus: dict) -> tuple[list[str], str]:
    """Every document of the configured corpus (all its sources, in order), and where they came from."""
    documents, descriptions = [], []
    for source in corpus_sources(corpus):
        texts, description, _ = source_documents(source)
        documents += texts
        descriptions.append(description)
    return documents, "; ".join(descriptions)


@dataclass
class SourceSplit:
    """One source's sequences, its normalised mixture weight and what identifies its text."""
    name: str
    weight: float
    train: torch.Tensor  # [sequences, seq_len] token ids
    heldout: torch.Tensor
    calibration: torch.Tensor
    description: str
    provenance: dict = field(default_factory=dict)
    duplicates_dropped: int = 0


@dataclass
class Corpus:
    """Every source's split, and the seed that draws the training sequences."""
    sources: list[SourceSplit]
    seed: int = 0
    _drawn: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=int), init=False, repr=False)
    _orders: dict = field(default_factory=dict, init=False, repr=False)

    @property
    def train(self) -> torch.Tensor:
        return torch.cat([s.train for s in self.sources])

    @property
    def heldout(self) -> torch.Tensor:
        return torch.cat([s.heldout for s in self.sources])

    @property
    def calibration(self) -> torch.Tensor:
        return torch.cat([s.calibration for s in self.sources])

    @property
    def description(self) -> str:
        return "; ".join(f"{s.name} ({s.weight:.3g}): {s.description}" if len(self.sources) > 1 else s.description
                         for s in self.sources)

    @property
    def duplicates_dropped(self) -> int:
        return sum(s.duplicates_dropped for s in self.sources)

    def source_of_slots(self, slots: int) -> np.ndarray:
        """The source index of each of the first ``slots`` training sequences, drawn at the weights
        (the same prefix however many are asked for: a resumed run draws what an unbroken one did)."""
        if len(self.sources) == 1:
            return np.zeros(slots, dtype=int)
        if len(self._drawn) < slots:  # drawn again, longer: uniform draws of one seed share their prefix
            bounds = np.cumsum([s.weight for s in self.sources])
            drawn = np.random.default_rng((self.seed, 2)).random(max(slots, 2 * len(self._drawn)))
            self._drawn = np.minimum(np.searchsorted(bounds, drawn, side="right"), len(self.sources) - 1)
        return self._drawn[:slots]

    def training_batch(self, position: int, count: int) -> tuple[torch.Tensor, np.ndarray]:
        """Training sequences ``position`` to ``position + count``, and the source index of each: each
        from the source drawn for it, the next of that source's shuffled order (wrapping around it: a
        further epoch)."""
        sources = self.source_of_slots(position + count)
        cursors = np.bincount(sources[:position], minlength=len(self.sources))
        rows = []
        for index in sources[position:]:
            order = self._order(index)
            rows.append(self.sources[index].train[order[cursors[index] % len(order)]])
            cursors[index] += 1
        return torch.stack(rows), sources[position:].copy()

    def _order(self, index: int) -> np.ndarray:
        if index not in self._orders:
            self._orders[index] = np.random.default_rng(_source_seed(self.seed + 1, index)).permutation(
                len(self.sources[index].train))
        return self._orders[index]

    def epochs_by_source(self, sequences_trained: int) -> dict[str, float]:
        """How many times each source's training sequences are gone through by ``sequences_trained``."""
        sources = self.source_of_slots(sequences_trained)
        return {s.name: float(np.count_nonzero(sources == i)) / max(1, len(s.train))
                for i, s in enumerate(self.sources)}

    def epochs(self, sequences_trained: int) -> float:
        """The most any source's training sequences are gone through by ``sequences_trained``."""
        return max(self.epochs_by_source(sequences_trained).values())


def _source_seed(seed: int, index: int):
    """The first source draws from ``seed`` itself, as a corpus of one source always did (its
    split and order are those of earlier runs); the others from (seed, index)."""
    return seed if index == 0 else (seed, index)


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
    """Each source's held-out, calibration and training sequences from disjoint documents (split
    fixed by ``seed``), the held-out and calibration counts shared out by weight; exact duplicate
    documents are dropped first (also across sources), so no text is in two splits."""
    sources = corpus_sources(corpus)
    weights = [s.weight for s in sources]
    seen: set[str] = set()
    splits = []
    for index, (source, heldout, calibration) in enumerate(zip(sources, shares(heldout_sequences, weights),
                                                               shares(calibration_sequences, weights))):
        key = f"corpus.mixture.{source.name}" if "mixture" in corpus else "corpus"
        splits.append(_split_source(tokenizer, source, key, seq_len, heldout, calibration,
                                    _source_seed(seed, index), seen))
    built = Corpus(splits, seed)
    if len(built.train) < batch_size:
        raise SparsifyError(f"corpus ({built.description}) gives {len(built.train)} training sequences of {seq_len} "
                            f"tokens, fewer than batch_size={batch_size}: add text or lower batch_size")
    return built


def _split_source(tokenizer, source: Source, key: str, seq_len: int, heldout_sequences: int,
                  calibration_sequences: int, seed, seen: set[str]) -> SourceSplit:
    documents, description, provenance = source_documents(source)
    unique = [d for d in dict.fromkeys(documents) if d not in seen]
    seen.update(unique)
    order = np.random.default_rng(seed).permutation(len(unique))
    token_ids = tokenizer([unique[i] for i in order], add_special_tokens=False).input_ids
    heldout_end = _take_documents(token_ids, 0, heldout_sequences, seq_len)
    calibration_end = _take_documents(token_ids, heldout_end, calibration_sequences, seq_len)
    heldout, calibration, train = (
        _pack(token_ids[a:b], tokenizer.eos_token_id, seq_len)
        for a, b in ((0, heldout_end), (heldout_end, calibration_end), (calibration_end, len(token_ids))))
    heldout, calibration = heldout[:heldout_sequences], calibration[:calibration_sequences]
    if len(heldout) < heldout_sequences or len(calibration) < calibration_sequences or len(train) < 1:
        raise SparsifyError(
            f"{key} ({description}) gives {len(train)} training, {len(heldout)} held-out and "
            f"{len(calibration)} calibration sequences of {seq_len} tokens from disjoint documents; "
            f"it needs at least 1 for training, {heldout_sequences} held-out (its share of heldout_sequences) "
            f"and {calibration_sequences} calibration (its share of calibrate_gate_bias.sequences): add text "
            "or lower those keys")
    for name, rows, what in (("held-out", heldout, "heldout_sequences"),
                             ("calibration", calibration, "calibrate_gate_bias.sequences")):
        shared = _shared_rows(rows, train)
        if shared:
            raise SparsifyError(
                f"{key} ({description}): {shared} {name} sequences also occur in the training text "
                f"(the same text in different documents); remove the repeated text from the corpus, "
                f"or change seed or {what} to draw other {name} documents")
    return SourceSplit(source.name, source.weight, train, heldout, calibration, description, provenance,
                       len(documents) - len(unique))


def report_corpus(corpus: Corpus, steps: int, batch_size: int, seq_len: int) -> float:
    """Log each source's split and the epochs that ``steps`` x ``batch_size`` make; warn above one
    epoch of any source (repeated text). Returns the largest number of epochs."""
    by_source = corpus.epochs_by_source(steps * batch_size)
    for source in corpus.sources:
        log.info("corpus source %s (weight %.3g): %s: %d training, %d held-out, %d calibration sequences of %d "
                 "tokens (disjoint documents; %d duplicate documents dropped); %.2f epochs in %d steps x %d "
                 "sequences", source.name, source.weight, source.description, len(source.train),
                 len(source.heldout), len(source.calibration), seq_len, source.duplicates_dropped,
                 by_source[source.name], steps, batch_size)
        if by_source[source.name] > 1:
            log.warning("the source %s holds %d training sequences, fewer than the %d that steps x batch_size "
                        "draws from it: training goes %.2f times through it (epochs). More text (corpus.hub or "
                        "corpus.paths) avoids repeating it", source.name, len(source.train),
                        round(by_source[source.name] * len(source.train)), by_source[source.name])
    return max(by_source.values())


def _shared_rows(rows: torch.Tensor, train: torch.Tensor) -> int:
    """How many of ``rows`` are identical to a training sequence."""
    seen = {row.numpy().tobytes() for row in train}
    return sum(row.numpy().tobytes() in seen for row in rows)
