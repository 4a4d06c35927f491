import dataclasses

import pandas as pd
import pytest
import torch

from attnlab.interventions import intervened
from attnlab.models import load_model, pick_device, pick_dtype
from attnlab.reasoning.generation import check_context, generate_all
from attnlab.reasoning.prompts import build_prompt

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


def _arithmetic_prompts(tokenizer, prompt_format: str, fewshot: int = 0, n: int = 5, slashes: int = 11):
    from attnlab.config.plan import fewshot_spec
    from attnlab.reasoning.data import fewshot_pool, prepare_dataset
    from attnlab.reasoning.prompts import make_prompts

    spec = {"source": {"arithmetic": {"low": 2, "high": 9, "ops": ["+", "-"]}}, "question": ["question"],
            "answer": "answer", "answer_format": "latex", "n": n, "seed": 0}
    items = prepare_dataset("arithmetic", spec)
    examples = fewshot_pool("arithmetic", fewshot_spec("arithmetic", spec), items, fewshot, 0) if fewshot else None
    return make_prompts(tokenizer, items, "mless", {"kind": "repeat", "unit": "/", "length": slashes},
                        {"system": "Put your final answer within \\boxed{}", "raw_template": "{system}\n{user}\nSolution:"},
                        prompt_format, 8192, examples)


@pytest.mark.parametrize("model_name", ["smollm2", "gemma3"])
def test_continuous_batching_gives_the_static_engine_tokens(model_name, request):
    """Greedy, float32, CPU: the same token ids for every prompt, EOS, stop strings (Gemma-3 base
    with few-shot examples stops at their blank line) and token-limit hits included; 3 rows at a
    time for 5 prompts, so slots are refilled."""
    from attnlab.tokenization import load_tokenizer

    folder = request.getfixturevalue(f"{model_name}_dir")
    tokenizer = load_tokenizer(folder)
    model = load_model(folder, torch.device("cpu"), torch.float32)
    raw = model_name == "gemma3"
    prompts = _arithmetic_prompts(tokenizer, "raw" if raw else "chat", fewshot=3 if raw else 0)
    stops = ["\n\n"] if raw else []
    static = generate_all(model, tokenizer, prompts, 3, 20, stops, engine="static")
    continuous = generate_all(model, tokenizer, prompts, 3, 20, stops, engine="continuous")
    assert set(continuous["engine"]) == {"continuous"} and set(static["engine"]) == {"static"}
    assert continuous["new_token_ids"].tolist() == static["new_token_ids"].tolist()
    pd.testing.assert_frame_equal(continuous.drop(columns="engine"), static.drop(columns="engine"))
    assert static["hit_token_limit"].any() or raw  # SmolLM2 runs into the limit, Gemma-3 stops
    if raw:
        assert (~static["hit_token_limit"]).all() and static["response"].str.contains("boxed").all()


def test_the_shared_prefix_gives_the_tokens_of_the_whole_prefill(gemma3_dir):
    """Gemma-3 base with 3 few-shot examples and a run of "/" (its sliding layers included): the
    static engine with the rows' shared prefix prefilled once gives the same tokens as without."""
    from attnlab.reasoning.shared_prefix import prefix_unshared, shared_prefix_length
    from attnlab.tokenization import load_tokenizer

    tokenizer = load_tokenizer(gemma3_dir)
    model = load_model(gemma3_dir, torch.device("cpu"), torch.float32)
    prompts = _arithmetic_prompts(tokenizer, "raw", fewshot=3, n=6)
    rows = [list(ids) for ids in prompts["input_ids"]]
    assert prefix_unshared(model, rows) is None and shared_prefix_length(rows) > 0.8 * min(map(len, rows))
    shared = generate_all(model, tokenizer, prompts, 6, 12, ["\n\n"], share_prefix=True)
    whole = generate_all(model, tokenizer, prompts, 6, 12, ["\n\n"], share_prefix=False)
    pd.testing.assert_frame_equal(shared, whole)


def test_stop_strings_end_rows_where_transformers_own_criterion_does(gemma3_dir):
    """StopOnStrings (ours: decodes the tail of each row's new tokens) stops at exactly the tokens where
    transformers' StopStringCriteria (``stop_strings``: a table over the vocabulary) stops: a
    one-token stop string, one spread over several tokens, and one that a token runs past."""
    from transformers import GenerationConfig

    from attnlab.tokenization import load_tokenizer

    tokenizer = load_tokenizer(gemma3_dir)
    model = load_model(gemma3_dir, torch.device("cpu"), torch.float32)
    prompts = _arithmetic_prompts(tokenizer, "raw", fewshot=2, n=4)  # " The answer is \\boxed{12}.\n\n..."
    batch = tokenizer.pad({"input_ids": [list(ids) for ids in prompts["input_ids"]]}, return_tensors="pt")
    for stops in (["boxed{1", "What"], ["}", "\n\n"]):  # "}" ends inside the token "}."
        ours = generate_all(model, tokenizer, prompts, 4, 16, stops)
        config = GenerationConfig(max_new_tokens=16, do_sample=False, stop_strings=stops,
                                  pad_token_id=tokenizer.pad_token_id,
                                  eos_token_id=model.generation_config.eos_token_id)
        with torch.inference_mode():
            library = model.generate(**batch, generation_config=config, tokenizer=tokenizer)
        library = library[:, batch["input_ids"].shape[1]:].tolist()
        assert (ours["n_new_tokens"] < 16).all(), stops
        for row, theirs in zip(ours["new_token_ids"], library):
            assert list(row) == theirs[:len(row)], stops
            assert all(t == tokenizer.pad_token_id for t in theirs[len(row):]), stops


def test_arm_changes_decoding_steps_under_continuous_batching(smollm2_dir, smollm2_tokenizer):
    """ARM's hook sees every decoding step of the engine (not only the prefill), with the
    positions that key its draws: the ARM generations equal the static engine's ARM ones."""
    from attnlab.interventions import mlp

    model = load_model(smollm2_dir, torch.device("cpu"), torch.float32)
    prompts = _arithmetic_prompts(smollm2_tokenizer, "chat", n=3)
    calls = []
    original = mlp.redistribute

    def counting(a, settings, positions, tokens):
        calls.append((tuple(a.shape[:-1]), positions.max().item()))
        return original(a, settings, positions, tokens)

    settings = mlp.ArmSettings(layer=0, c=0.3, pmax=0.5)
    plain = generate_all(model, smollm2_tokenizer, prompts, 3, 12, engine="continuous")
    assert set(plain["engine"]) == {"continuous"}
    mlp.redistribute = counting
    try:
        with intervened(model, arm=settings):
            static = generate_all(model, smollm2_tokenizer, prompts, 3, 12, engine="static")
            calls.clear()
            continuous = generate_all(model, smollm2_tokenizer, prompts, 3, 12, engine="continuous")
    finally:
        mlp.redistribute = original
    longest = int(prompts["n_prompt_tokens"].max())
    assert any(position >= longest for _, position in calls)  # decoding steps, past every prompt
    assert continuous["new_token_ids"].tolist() == static["new_token_ids"].tolist()
    assert continuous["new_token_ids"].tolist() != plain["new_token_ids"].tolist()


def test_continuous_batching_fails_for_a_sparse_copy_unless_told_to_fall_back(smollm2_dir, smollm2_tokenizer,
                                                                              caplog):
    from attnlab.reasoning.generation import ContinuousBatchingFailed, continuous_unsupported

    model = load_model(smollm2_dir, torch.device("cpu"), torch.float32)
    model.config.attnlab_sparse = {"gate_bias": 6.0}
    assert "gated attention" in continuous_unsupported(model)
    prompts = _arithmetic_prompts(smollm2_tokenizer, "chat", n=2)
    with pytest.raises(ContinuousBatchingFailed, match="gated attention.*continuous_or_static"):
        generate_all(model, smollm2_tokenizer, prompts, 2, 4, engine="continuous")
    with caplog.at_level("WARNING"):
        out = generate_all(model, smollm2_tokenizer, prompts, 2, 4, engine="continuous_or_static")
    assert len(out) == 2 and "static engine" in caplog.text and "gated attention" in caplog.text
    assert set(out["engine"]) == {"static"}
    with pytest.raises(ValueError, match="unknown generation engine 'paged'"):
        generate_all(model, smollm2_tokenizer, prompts, 2, 4, engine="paged")


def test_static_cache_engine_gives_the_static_engine_tokens_on_smollm2(smollm2_dir, smollm2_tokenizer):
    """The static-cache loop (attnlab.reasoning.decoding; CUDA graphs on GPUs, the same loop without them
    here) against transformers' generate, float32: the same tokens, lengths and responses, rows
    ending at EOS, at a stop string (a newline) and at the limit."""
    model = load_model(smollm2_dir, torch.device("cpu"), torch.float32)
    prompts = _arithmetic_prompts(smollm2_tokenizer, "chat", n=6)
    for stops in ([], ["\n"]):
        static = generate_all(model, smollm2_tokenizer, prompts, 4, 30, stops, engine="static")
        cached = generate_all(model, smollm2_tokenizer, prompts, 4, 30, stops, engine="static_cache")
        assert set(cached["engine"]) == {"static_cache"}
        pd.testing.assert_frame_equal(cached.drop(columns="engine"), static.drop(columns="engine"))
        assert static["hit_token_limit"].any() and not static["hit_token_limit"].all()


def test_static_cache_engine_gives_the_static_engine_tokens_on_gemma3_past_its_window(gemma3_dir):
    """Gemma-3 base, float32, with prompts longer than its sliding window (512): its sliding layers
    read through their own mask in the static-cache loop, and give the static engine's tokens, rows
    ending at the few-shot examples' blank line or at the limit; batches of 3 for 4 prompts of
    different lengths (left padding)."""
    from attnlab.tokenization import load_tokenizer

    tokenizer = load_tokenizer(gemma3_dir)
    model = load_model(gemma3_dir, torch.device("cpu"), torch.float32)
    window = model.config.get_text_config().sliding_window
    prompts = _arithmetic_prompts(tokenizer, "raw", fewshot=3, n=4, slashes=window)
    assert prompts["n_prompt_tokens"].min() > window + 20
    static = generate_all(model, tokenizer, prompts, 3, 24, ["\n\n"], engine="static")
    cached = generate_all(model, tokenizer, prompts, 3, 24, ["\n\n"], engine="static_cache")
    assert set(cached["engine"]) == {"static_cache"}
    pd.testing.assert_frame_equal(cached.drop(columns="engine"), static.drop(columns="engine"))
    assert static["response"].str.contains("boxed").all()


@dataclasses.dataclass
class _ConfigOf517:
    """transformers 5.17's ContinuousBatchingConfig fields that generation sets (GPU images carry
    5.17): the page is ``block_size``, and there is no ``auto_switch_to_flash``."""
    block_size: int = 256
    num_blocks: int | None = None
    max_batch_tokens: int | None = None
    max_requests_per_batch: int | None = None
    allow_block_sharing: bool = True
    seed: int | None = None


@dataclasses.dataclass
class _ConfigWithoutSeed:
    page_size: int = 256
    num_blocks: int | None = None
    max_batch_tokens: int | None = None
    max_requests_per_batch: int | None = None
    allow_block_sharing: bool = True


def test_the_continuous_config_is_built_from_the_installed_transformers_fields():
    from transformers import ContinuousBatchingConfig

    from attnlab.reasoning.generation import ContinuousBatchingFailed, continuous_batching_config

    settings = dict(num_blocks=9, max_requests_per_batch=4, max_batch_tokens=512, allow_block_sharing=False, seed=0)
    installed = continuous_batching_config(ContinuousBatchingConfig, 64, **settings)
    assert (installed.page_size, installed.auto_switch_to_flash, installed.num_blocks) == (64, False, 9)
    older = continuous_batching_config(_ConfigOf517, 64, **settings)
    assert older == _ConfigOf517(block_size=64, num_blocks=9, max_batch_tokens=512, max_requests_per_batch=4,
                                 allow_block_sharing=False, seed=0)
    with pytest.raises(ContinuousBatchingFailed, match="has no seed"):
        continuous_batching_config(_ConfigWithoutSeed, 64, **settings)


def test_a_continuous_config_this_transformers_refuses_falls_back_to_static(smollm2_dir, smollm2_tokenizer,
                                                                          monkeypatch, caplog):
    import transformers

    from attnlab.reasoning.generation import ContinuousBatchingFailed

    monkeypatch.setattr(transformers, "ContinuousBatchingConfig", _ConfigWithoutSeed)
    model = load_model(smollm2_dir, torch.device("cpu"), torch.float32)
    prompts = _arithmetic_prompts(smollm2_tokenizer, "chat", n=2)
    with pytest.raises(ContinuousBatchingFailed, match="has no seed.*continuous_or_static"):
        generate_all(model, smollm2_tokenizer, prompts, 2, 4, engine="continuous")
    with caplog.at_level("WARNING"):
        out = generate_all(model, smollm2_tokenizer, prompts, 2, 4, engine="continuous_or_static")
    static = generate_all(model, smollm2_tokenizer, prompts, 2, 4, engine="static")
    assert set(out["engine"]) == {"static"} and "has no seed" in caplog.text
    assert out["new_token_ids"].tolist() == static["new_token_ids"].tolist()


def test_the_static_engine_leaves_cudnn_attention_out_on_cuda_only():
    """cuDNN's attention made bf16 static decoding 3.7x slower on an H200; the flags are read
    inside the context (entering it needs no GPU)."""
    from attnlab.reasoning.generation import attention_backends

    with attention_backends(torch.device("cuda")):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
        assert torch.backends.cuda.math_sdp_enabled()
    before = torch.backends.cuda.cudnn_sdp_enabled()
    with attention_backends(torch.device("cpu")):
        assert torch.backends.cuda.cudnn_sdp_enabled() == before


def test_the_static_engine_generates_inside_the_backend_choice(monkeypatch):
    from attnlab.reasoning import generation
    from test_decoding import _model, _prompts, _Tokenizer

    entered, choose = [], generation.attention_backends
    monkeypatch.setattr(generation, "attention_backends", lambda device: (entered.append(device.type), choose(device))[1])
    generate_all(_model(), _Tokenizer(), _prompts(), 4, 3, engine="static")
    assert entered == ["cpu", "cpu"]  # one per batch of 4 (6 prompts)
