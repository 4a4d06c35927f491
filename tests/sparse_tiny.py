"""The tiny model sparse post-training is tested on, its settings and a run of it, shared by
test_sparsify.py, test_sparsify_inputs.py (and the session's fixtures ``tiny_base`` and ``trained``,
conftest.py). Not a test module."""

import json
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from attnlab import sparsify


def make_tiny_base(folder: Path, tokenizer_dir: Path) -> tuple[Path, Path]:
    """A tiny random Llama (GQA) with the tokenizer of ``tokenizer_dir``, saved like a prepared model in
    ``folder``/tiny-base, and a corpus of 60 short documents beside it: (model folder, corpus)."""
    from attnlab.tokenization import load_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         max_position_embeddings=128, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # attention logits of order 1, so a gate bias of 1 closes some edges
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight *= 30
            layer.self_attn.k_proj.weight *= 30
    out = folder / "tiny-base"
    model.save_pretrained(out)
    load_tokenizer(tokenizer_dir).save_pretrained(out)
    corpus = out.parent / "corpus.jsonl"
    rng = np.random.default_rng(0)
    words = "the cat sat on a mat while two dogs ran far away from home".split()
    corpus.write_text("".join(json.dumps({"text": " ".join(rng.choice(words, 40))}) + "\n" for _ in range(60)))
    return out, corpus


PER_LAYER_OFF = {"enabled": False, "step": 1.0, "rounds": 2, "sensitivity_sequences": 8}


def tiny_settings(corpus, **changes):
    settings = {
        "base": "tiny-base", "gate_bias": 1.0, "gate_gradient": "expected", "train": "all",
        "lora": {"rank": 4, "alpha": 8, "modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
        "lr": 1e-3, "lr_schedule": "constant", "weight_decay": 0.0, "warmup_steps": 2, "steps": 6, "batch_size": 2, "seq_len": 16,
        "grad_clip": 1.0, "constraint": {"type": "kl", "slack": 0.05},
        "multiplier": {"init": 1.0, "lr": 1.0, "ema": 0.9, "min": 1e-3, "max": 1e3}, "seed": 0,
        "corpus": {"paths": [str(corpus)], "text_field": "text"}, "heldout_sequences": 4,
        "eval_every": 3, "checkpoint_every": 2, "log_every": 1, "device": "cpu", "dtype": "auto",
        "gradient_checkpointing": False, "snapshot_steps": [],
        "calibrate_gate_bias": {"enabled": False, "max_kl": 0.12, "step": 0.5, "lowest": -2.0, "sequences": 32,
                                "per_layer": PER_LAYER_OFF},
    }
    settings.update(changes)
    return settings

def tiny_outputs(folder: Path) -> sparsify.Outputs:
    return sparsify.Outputs(model_dir=str(folder / "model"), steps=str(folder / "steps.csv"),
                            evals=str(folder / "eval.csv"), density=str(folder / "density.csv"),
                            summary=str(folder / "summary.json"))


def post_train_tiny(base, settings: dict, folder: Path, **options) -> dict:
    """post_train (checkpoint in ``folder``), its outputs written there as the workflow's step
    writes them; returns the summary."""
    result = sparsify.post_train(str(base), "tiny-sparse", settings, str(folder / "ckpt.pt"),
                                 torch.device("cpu"), **options)
    sparsify.write_outputs(result, "tiny-sparse", settings, tiny_outputs(folder))
    return result.summary
