"""The tasks of a ground-truth model, in attnlab's task system (``tasks.generate_task`` with the
model's folder): clean and corrupted inputs of the spec's full length, read at the last position.

- ``program``: a clean input drawn at random, the corrupted one redrawn until the read output
  differs (a numerical output: the pair ordered so that the clean one is larger, so the mean
  metric moves one way): the corruption changes what the circuit reads. The metric is the logit of the clean
  output's word minus the corrupted output's (a numerical output: its readout word minus the
  zero word).
- ``program_control``: the negative control. The corrupted input follows the program's control
  rule (the spec's ``control``): ``keep_positions`` redraws every other position, ``permute_
  positions`` shuffles the given positions, ``keep_values`` redraws the tokens keeping one
  operation's values everywhere. The output, and everything the circuit computes at the read
  position, stays; every effect must be zero. Its metric's distractor is the output word after
  the clean one.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from attnlab.config.sources import PROGRAM_SPEC
from attnlab.groundtruth.convert import VALUE_WORD, ZERO_WORD
from attnlab.groundtruth.program import Program
from attnlab.patching.tasks import TaskError, TaskPrompts, check_alignment, generate_task

TASKS = ("program", "program_control")
ATTEMPTS = 1000


def prompts_for(task: str, tokenizer, n: int, seed: int, model_dir) -> TaskPrompts:
    """A task's prompts for the model in ``model_dir``: a compiled program's own tasks from its
    spec, every other task from attnlab.patching.tasks."""
    if task not in TASKS:
        return generate_task(task, tokenizer, n, seed)
    prompts = generate(task, tokenizer, n, seed, model_dir)
    check_alignment(tokenizer, prompts)
    return prompts


def read_spec(model_dir: str | Path | None) -> dict:
    path = Path(model_dir or "") / PROGRAM_SPEC
    if model_dir is None or not path.is_file():
        raise TaskError(f"tasks {TASKS} need a ground-truth model (a folder with {PROGRAM_SPEC}, as "
                        f"`make groundtruth-models` writes under data/groundtruth); {model_dir} has none")
    return json.loads(path.read_text())


def generate(task: str, tokenizer, n: int, seed: int, model_dir) -> TaskPrompts:
    spec = read_spec(model_dir)
    read = spec["programs"][spec["readout"]]
    program, rng = Program.of(read["program"]), random.Random(f"{task} {seed}")
    draw = (lambda: _corrupted(program, spec, rng)) if task == "program" else (lambda: _control(program, spec, read, rng))
    out = TaskPrompts(task, [], [], [], [], [], info={"program": spec["readout"], "stack": spec["stack"],
                                                      "control": read["control"] if task != "program" else None})
    for _ in range(n):
        clean, corrupted = draw()
        out.clean.append(" ".join(clean))
        out.corrupted.append(" ".join(corrupted))
        out.templates.append(0)
        answer, distractor = _words(program, read, clean, corrupted)
        out.answers.append(tokenizer.convert_tokens_to_ids(answer))
        out.distractors.append([tokenizer.convert_tokens_to_ids(distractor)])
    return out


def token_pairs(prompts: TaskPrompts) -> list[tuple[list[str], list[str]]]:
    """The (clean, corrupted) token lists of a program task's prompts (BOS excluded)."""
    return [(clean.split(), corrupted.split()) for clean, corrupted in zip(prompts.clean, prompts.corrupted)]


def _read(program: Program, tokens: list) -> object:
    return program.evaluate(tokens)[program.output][-1]


def _draw(spec: dict, rng: random.Random) -> list[str]:
    return [rng.choice(spec["vocab"]) for _ in range(spec["max_len"])]


def _corrupted(program: Program, spec: dict, rng: random.Random) -> tuple[list, list]:
    for _ in range(ATTEMPTS):
        clean, corrupted = _draw(spec, rng), _draw(spec, rng)
        clean_output, corrupted_output = _read(program, clean), _read(program, corrupted)
        if clean_output != corrupted_output:
            # a numerical output: the larger one clean, so the metric's mean moves one way
            swap = spec["programs"][spec["readout"]]["numerical"] and clean_output < corrupted_output
            return (corrupted, clean) if swap else (clean, corrupted)
    raise TaskError(f"no input changes {spec['readout']}'s output in {ATTEMPTS} draws")


def _control(program: Program, spec: dict, read: dict, rng: random.Random) -> tuple[list, list]:
    rule = read["control"]
    for _ in range(ATTEMPTS):
        clean = _draw(spec, rng)
        corrupted = list(clean)
        if rule["kind"] == "keep_positions":
            corrupted = [t if i in rule["positions"] else rng.choice(spec["vocab"]) for i, t in enumerate(clean)]
        elif rule["kind"] == "permute_positions":
            shuffled = [clean[i] for i in rule["positions"]]
            rng.shuffle(shuffled)
            for i, token in zip(rule["positions"], shuffled):
                corrupted[i] = token
        elif rule["kind"] == "keep_values":
            corrupted = _draw(spec, rng)
            if program.evaluate(corrupted)[rule["op"]] != program.evaluate(clean)[rule["op"]]:
                continue
        else:
            raise TaskError(f"unknown control rule {rule}")
        if corrupted != clean:
            return clean, corrupted
    raise TaskError(f"no control pair for {spec['readout']} under {rule} in {ATTEMPTS} draws")


def _words(program: Program, read: dict, clean: list, corrupted: list) -> tuple[str, str]:
    """The metric's answer and distractor words."""
    if read["numerical"]:
        return VALUE_WORD, ZERO_WORD
    words, values = read["output_words"], read["output_values"]
    right, wrong = _read(program, clean), _read(program, corrupted)
    answer = words[values.index(right)]
    if wrong == right:  # a control pair: the next word stands in
        return answer, words[(words.index(answer) + 1) % len(words)]
    return answer, words[values.index(wrong)]
