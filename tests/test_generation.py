import pandas as pd
import pytest
import torch

from attnlab.generation import check_context, generate_all
from attnlab.models import load_model, pick_device, pick_dtype
from attnlab.prompts import build_prompt

pytestmark = pytest.mark.slow


def test_batched_greedy_matches_one_by_one(smollm2_dir, smollm2_tokenizer):
    """Left padding must not change what greedy decoding produces."""
    tok = smollm2_tokenizer
    model = load_model(smollm2_dir, torch.device("cpu"), torch.float32)
    questions = ["What is 2 + 3?", "Name a colour.", "Tom has 12 apples and eats 5. How many are left now?"]
    ids = [build_prompt(tok, "chat", "", "Be brief.", "", q).input_ids for q in questions]
    prompts = pd.DataFrame({"id": ["a", "b", "c"], "input_ids": ids, "n_prompt_tokens": [len(i) for i in ids]})
    batched = generate_all(model, tok, prompts, batch_size=3, max_new_tokens=12)
    single = generate_all(model, tok, prompts, batch_size=1, max_new_tokens=12)
    assert batched["id"].tolist() == ["a", "b", "c"]
    assert batched["response"].tolist() == single["response"].tolist()
    assert (batched["n_new_tokens"] <= 12).all() and (batched["n_new_tokens"] > 0).all()


def test_context_check_names_the_item():
    prompts = pd.DataFrame({"id": ["x", "y"], "n_prompt_tokens": [10, 95]})
    check_context(prompts, 5, 100)
    with pytest.raises(ValueError, match="item 'y': 95 prompt tokens \\+ 10 new tokens exceed"):
        check_context(prompts, 10, 100)


def test_device_and_dtype_choice():
    device = pick_device("auto")
    assert device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert pick_dtype("auto", torch.device("cpu")) == torch.float32
    assert pick_dtype("auto", torch.device("cuda")) == torch.bfloat16
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            pick_device("cuda")
