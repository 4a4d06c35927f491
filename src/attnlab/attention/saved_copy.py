"""A sparse copy's folder as plain transformers meets it: never silently the dense model.

Its config.json names an attention no transformers can run (``sparse.SAVED_IMPLEMENTATION``), whose
name says how to open the copy: plain ``from_pretrained`` refuses it, echoing that name. The folder
carries a module of its own (``auto_map``), so that ``AutoModelForCausalLM.from_pretrained(folder,
trust_remote_code=True)`` loads the gated model with nothing imported before; attnlab's loader
(``models.load_model``) reads the name as its gated attention and never runs folder code. A
README.md model card says what the copy is, its held-out numbers and how to open it.
"""

from __future__ import annotations

import json
from pathlib import Path

from attnlab.attention.sparse import IMPLEMENTATION, SAVED_IMPLEMENTATION

MODULE = "attnlab_sparse_copy"
CLASS = "SparseCopy"

_CODE = '''"""A sparse copy made by attnlab (edge gates on attention, arXiv 2512.05865). Loaded through this
module (``trust_remote_code=True``), its gated attention is registered and selected; needs attnlab
installed. attnlab's own loader: ``attnlab.models.load_model(folder, device, dtype)``."""

import transformers

from attnlab.attention import sparse
import attnlab.attention.function  # noqa: F401 -- registers the gated attention ("{implementation}")


class {name}(transformers.{base}):
    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        # config.json names an attention that says how to open the copy; it runs as this one
        kwargs["attn_implementation"] = "{implementation}"
        model = super().from_pretrained(*args, **kwargs)
        sparse.activate(model)
        return model
'''


def mark(folder: str | Path, architecture: str) -> None:
    """Make a saved sparse copy in ``folder`` (its class ``architecture``, e.g. LlamaForCausalLM)
    refused by plain ``from_pretrained``, saying how to open it, and loaded gated with
    ``trust_remote_code=True`` (module docstring)."""
    folder = Path(folder)
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    config["attn_implementation"] = SAVED_IMPLEMENTATION
    config["auto_map"] = {"AutoModelForCausalLM": f"{MODULE}.{CLASS}"}
    config_file.write_text(json.dumps(config, indent=2) + "\n")
    (folder / f"{MODULE}.py").write_text(_CODE.format(name=CLASS, base=architecture, implementation=IMPLEMENTATION))


def write_card(folder: str | Path, name: str, summary: dict) -> None:
    """A README.md model card in ``folder``: what the copy is, how to open it, its held-out numbers
    as ``summary`` gives them (run.py's summary or a snapshot's) and where its provenance is."""
    numbers = [("base model", summary.get("base")), ("post-training steps", summary.get("steps", summary.get("snapshot_step"))),
               ("training tokens", summary.get("tokens")),
               ("gate bias at inference", summary.get("inference_gate_bias")),
               ("held-out density (share of causal query-key edges open)", summary.get("heldout_density")),
               ("held-out KL(dense ‖ sparse), nats per token", summary.get("heldout_kl")),
               ("held-out cross-entropy, dense / sparse, nats per token",
                f"{summary['heldout_ce_dense']} / {summary['heldout_ce_sparse']}" if "heldout_ce_sparse" in summary
                else None)]
    rows = "\n".join(f"| {label} | {value} |" for label, value in numbers if value is not None)
    (Path(folder) / "README.md").write_text(_CARD.format(name=name, rows=rows))


_CARD = """---
library_name: transformers
tags: [attnlab, sparse-attention, interpretability]
---
# {name}: a sparse copy made by attnlab

Edge gates on attention (sparse attention post-training, arXiv 2512.05865): each query-key edge
of each head is open or closed by a learned gate, and the model was trained to keep its base's
loss with few edges open. Its weights alone are not the model: run without its gates, it is a
different, dense model. Plain `AutoModelForCausalLM.from_pretrained(folder)` therefore refuses
it. Open it in either of two ways:

```python
from attnlab.models import load_model
model = load_model(folder, device, dtype)  # attnlab's loader: runs no code from the folder

from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)  # attnlab installed
```

The second runs `attnlab_sparse_copy.py` from this folder, which registers the gated attention.

| | |
|---|---|
{rows}

Densities are measured at the gate bias above, on held-out text of the training corpus. The whole
provenance (settings, corpus, per-source numbers, versions) is in `attnlab_source.json` (under
`copied_provenance` in a copy prepared from another folder).
"""
