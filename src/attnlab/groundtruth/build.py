"""Build the ground-truth models (needs tracr: ``make groundtruth-models``):

    python -m attnlab.groundtruth.build data/groundtruth

Each model is a folder a workflow config names as a local source: the GPT-2 weights
(safetensors), its config, a word-level tokenizer, and ``attnlab_program.json`` (the spec: the
serialized programs, the block computing each operation, the readout, the negative control's
rule, and tracr's own outputs on every input, which tests/test_groundtruth.py compares the
converted model with). Single programs: reverse, frac_prevs, hist; the three side by side in one
model, read at each program's output in turn.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import numpy as np
import torch

from attnlab.config.sources import PROGRAM_SPEC
from attnlab.groundtruth import compiled as tracr_side
from attnlab.groundtruth.convert import gpt2_config, output_words, state_dict, vocabulary, word_tokenizer
from attnlab.io import atomic_path

log = logging.getLogger(__name__)

STACK = ("reverse", "frac_prevs", "hist")
MODELS = {"tracr-reverse": (("reverse",), "reverse"), "tracr-frac-prevs": (("frac_prevs",), "frac_prevs"),
          "tracr-hist": (("hist",), "hist"),
          **{f"tracr-stack-{name.replace('_', '-')}": (STACK, name) for name in STACK}}


def control_rule(program: tracr_side.Compiled) -> dict:
    """The negative control's corruption: a change that leaves the read output and everything the
    circuit computes at the read position as they are."""
    if program.name == "reverse":  # the last position reads the first token alone
        return {"kind": "keep_positions", "positions": [0]}
    if program.name == "hist":  # the count of the last token is the same in any order of the others
        return {"kind": "permute_positions", "positions": list(range(tracr_side.MAX_LEN - 1))}
    maps = [label for label, op in program.program["ops"].items() if op["kind"] == "map"]
    return {"kind": "keep_values", "op": maps[0]}  # frac_prevs: tokens other than "a" swapped


def spec(name: str, programs: list, readout: int, words: list[str], layout) -> dict:
    described = {}
    for p, program in enumerate(programs):
        blocks = {op: {**block, **({"head": [block["head"][0], layout.head_offsets[p] + block["head"][1]]}
                                   if "head" in block else {})} for op, block in program.blocks.items()}
        described[program.name] = {"program": program.program, "evaluations": program.evaluations, "blocks": blocks,
                                   "numerical": program.output_values == [None],
                                   "output_words": output_words(program), "output_values": program.output_values,
                                   "control": control_rule(program)}
    read = programs[readout]
    return {"name": name, "stack": [p.name for p in programs], "readout": read.name, "bos": tracr_side.BOS,
            "vocab": list(tracr_side.VOCAB), "max_len": tracr_side.MAX_LEN, "words": words,
            "programs": described, "reference": read.reference, "compiler": _versions()}


def _versions() -> dict:
    from importlib.metadata import version

    return {package: version(package) for package in ("tracr-pypi", "jax", "dm-haiku")}


def write_model(folder: Path, name: str, programs: list, readout: int) -> float:
    """Write one model; the largest difference between its outputs and tracr's (float32)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    words = vocabulary(programs, tracr_side.BOS)
    weights, layout = state_dict(programs, readout, words, tracr_side.BOS)
    config = GPT2Config(**gpt2_config(layout, words, programs[0].params["pos_embed"].shape[0], tracr_side.BOS))
    model = GPT2LMHeadModel(config)
    model.load_state_dict({key: torch.tensor(value, dtype=torch.float32) for key, value in weights.items()},
                          strict=False)  # the attention's causal-mask buffers are the model's own
    model.eval()
    described = spec(name, programs, readout, words, layout)
    worst = fidelity(model, word_tokenizer(words, tracr_side.BOS), described)
    described["fidelity_max_abs_diff"] = worst
    with atomic_path(folder, directory=True) as tmp:
        model.save_pretrained(tmp)
        word_tokenizer(words, tracr_side.BOS).save_pretrained(tmp)
        (tmp / PROGRAM_SPEC).write_text(json.dumps(described, separators=(",", ":")) + "\n")
    return worst


def fidelity(model, tokenizer, described: dict) -> float:
    """max |logit − tracr's output| over every input and position, at the readout's words."""
    reference = described["reference"]
    ids = tokenizer([" ".join(tokens) for tokens in reference["inputs"]], return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits.double().numpy()
    read = described["programs"][described["readout"]]
    columns = [described["words"].index(word) for word in read["output_words"]]
    return float(np.abs(logits[:, :, columns] - np.array(reference["outputs"])).max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="folder to write the models into (one subfolder each)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    compiled = {name: tracr_side.compile_program(name) for name in tracr_side.PROGRAMS}
    for name, (stack, readout) in MODELS.items():
        worst = write_model(Path(args.out) / name, name, [compiled[p] for p in stack], stack.index(readout))
        log.info("%s: largest difference from tracr's outputs %.2e", name, worst)


if __name__ == "__main__":
    main()
