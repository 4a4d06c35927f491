"""A sparse copy's folder as plain transformers meets it: never silently the dense model.

Its config.json names the gated attention (``attn_implementation: attnlab``): ``from_pretrained``
then fails loudly unless the gated attention is registered (``import attnlab.attention.function``),
and runs the gates when it is. The folder also carries a module of its own (``auto_map``), so that
``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` loads the gated model
with nothing imported before; attnlab's loader (``models.load_model``) never runs folder code.
"""

from __future__ import annotations

import json
from pathlib import Path

from attnlab.attention.sparse import IMPLEMENTATION

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
        model = super().from_pretrained(*args, **kwargs)
        sparse.activate(model)
        return model
'''


def mark(folder: str | Path, architecture: str) -> None:
    """Make a saved sparse copy in ``folder`` (its class ``architecture``, e.g. LlamaForCausalLM)
    load gated or fail loudly under plain transformers (module docstring)."""
    folder = Path(folder)
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    config["attn_implementation"] = IMPLEMENTATION
    config["auto_map"] = {"AutoModelForCausalLM": f"{MODULE}.{CLASS}"}
    config_file.write_text(json.dumps(config, indent=2) + "\n")
    (folder / f"{MODULE}.py").write_text(_CODE.format(name=CLASS, base=architecture, implementation=IMPLEMENTATION))
