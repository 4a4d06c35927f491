"""Behaviours of sparse post-training no other fast test pinned: the ce_control step's constraint
against its dense control plus the slack, a damaged resume checkpoint refused with its file and
the fix, and a document two corpus sources share kept out of one side of the split. Each on a
tiny random Llama or a word-level stand-in tokenizer built here (no converted model), against
numbers worked out by hand."""

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from attnlab import sparsify
from attnlab.sparsify.errors import SparsifyError
from sparse_tiny import tiny_settings

VOCAB = 64


@pytest.fixture(scope="module")
def small_base(tmp_path_factory):
    """A random 1-layer Llama of 64 tokens saved as a prepared model (no tokenizer: the trainer
    reads token ids only)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                         max_position_embeddings=32, tie_word_embeddings=True)
    folder = tmp_path_factory.mktemp("small") / "base"
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder


def _fixed_logits_head(model, token: int, logit: float) -> None:
    """Replace the model's output head with one whose logits are ``logit`` on ``token`` and 0 on
    every other token at every position, whatever the input: its CE on a row of ``token`` is
    then log(e^logit + VOCAB - 1) - logit, known by hand."""
    head = torch.nn.Linear(model.lm_head.in_features, VOCAB, bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.zero_()
        head.bias[token] = logit
    model.lm_head = head


def test_a_ce_control_steps_constraint_is_the_copys_ce_less_the_controls_ce_plus_the_slack(small_base):
    """Under ce_control a step holds the copy's CE to the dense control's CE on the same batch
    plus the slack: C = CE_copy - (CE_control + slack). Only the plain ce bound was pinned, so the
    base's CE in place of the control's, or the slack subtracted, passed every test. The copy's and
    the control's heads give fixed logits (7: 2 and 5 nats over the rest), the batch is token 7
    throughout, and the base (untouched: about 3.9 nats) would give another number."""
    settings = tiny_settings(None, constraint={"type": "ce_control", "slack": 0.1}, gate_bias=1.0)
    trainer = sparsify.Trainer(str(small_base), settings, torch.device("cpu"))
    _fixed_logits_head(trainer.student, token=7, logit=2.0)
    _fixed_logits_head(trainer.control, token=7, logit=5.0)
    row = trainer.step(torch.full((2, 16), 7), sparsify.TrainState())
    copy_ce = math.log(math.exp(2.0) + 63) - 2.0  # 2.2540
    control_ce = math.log(math.exp(5.0) + 63) - 5.0  # 0.3537
    assert row["ce"] == pytest.approx(copy_ce, abs=1e-5)
    # 2.2540 - (0.3537 + 0.1) = 1.8003; a subtracted slack gives 2.0003, the base's CE (3.9) -1.7
    assert row["constraint"] == pytest.approx(copy_ce - (control_ce + 0.1), abs=1e-5)
    assert row["constraint"] == pytest.approx(1.8003, abs=1e-3)
    assert row["control_ce"] == pytest.approx(control_ce, abs=1e-5)  # what the steps table reports


def test_a_truncated_resume_checkpoint_is_refused_naming_the_file_and_the_fix(small_base, tmp_path):
    """A job killed while a disk filled, or a copy cut short, leaves half a checkpoint; the next
    job must say which file it is and to delete it (training then starts from step 0), not fail
    inside torch's zip reader. Only files that would run code and dicts of other keys were
    tested."""
    trainer = sparsify.Trainer(str(small_base), tiny_settings(None), torch.device("cpu"))
    path = tmp_path / "ckpt.pt"
    trainer.save_checkpoint(path, sparsify.TrainState(step=2, position=4), "fingerprint")
    assert trainer.load_checkpoint(path, "fingerprint").step == 2  # whole, it resumes
    whole = path.read_bytes()
    path.write_bytes(whole[:len(whole) // 2])
    with pytest.raises(SparsifyError) as refused:
        trainer.load_checkpoint(path, "fingerprint")
    message = str(refused.value)
    assert str(path) in message and "damaged" in message
    assert "Delete it to train from step 0" in message


class _WordTokenizer:
    """A stand-in tokenizer: one id per distinct word in order of first sight, EOS 0 (what
    build_corpus calls: the call with add_special_tokens, .input_ids and eos_token_id)."""

    eos_token_id = 0

    def __init__(self):
        self.ids = {}

    def __call__(self, texts, add_special_tokens=False):
        rows = [[self.ids.setdefault(word, len(self.ids) + 1) for word in text.split()] for text in texts]
        return type("Encoded", (), {"input_ids": rows})()


def _source(path, prefix: str, shared: str):
    """A .jsonl of 12 documents of 7 distinct words (with EOS one row of 8 tokens each) and
    ``shared`` among them."""
    documents = [" ".join(f"{prefix}{n}w{k}" for k in range(7)) for n in range(11)] + [shared]
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in documents))
    return {"weight": 1.0, "paths": [str(path)], "text_field": "text"}


def test_a_document_in_two_sources_is_kept_in_the_first_alone_on_one_side_of_the_split(tmp_path):
    """A document in two sources, split apart in each, could be held out in one and trained on
    in the other: a held-out number on trained text. build_corpus drops exact duplicates across
    sources too (its docstring): the first source keeps the document, the second drops it (and
    counts it). Each document packs to exactly one row, so the document's row is found whole.
    Over several seeds (each a different side for it)."""
    shared = "zebra quartz violin harbor meadow lantern orbit"
    corpus = {"mixture": {"a": _source(tmp_path / "a.jsonl", "a", shared),
                          "b": _source(tmp_path / "b.jsonl", "b", shared)}}
    sides = set()
    for seed in range(6):
        tokenizer = _WordTokenizer()
        built = sparsify.build_corpus(tokenizer, corpus, 8, 4, 1, seed, 2)
        row = torch.tensor(tokenizer([shared]).input_ids[0] + [0])
        found = [(source.name, side) for source in built.sources for side in ("train", "heldout", "calibration")
                 for candidate in getattr(source, side) if torch.equal(candidate, row)]
        assert len(found) == 1 and found[0][0] == "a", (seed, found)
        assert [s.duplicates_dropped for s in built.sources] == [0, 1]
        # 12 rows in a, 11 in b: 2 held-out and 1 calibration each, the rest trained on
        assert [(len(s.heldout), len(s.calibration), len(s.train)) for s in built.sources] == [(2, 1, 9), (2, 1, 8)]
        sides.add(found[0][1])
    assert {"train", "heldout"} <= sides  # the seeds put it on both sides: the check covers each
