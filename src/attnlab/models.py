"""Turn any configured model source into a plain Hugging Face folder, and load it."""

from __future__ import annotations

import copy
import importlib
import json
import logging
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.initialization import no_init_weights

import attnlab.attention.function  # noqa: F401 -- registers the gated attention a sparse copy selects
from attnlab import conversion_cache
from attnlab.anatomy.families import family_of
from attnlab.attention import saved_copy, sparse
from attnlab.config.checks import check_chat_template, damaged_model_files, prepared_has_chat_template
from attnlab.config.sources import check_model_source, package_folder, program_spec
from attnlab.io import atomic_path
from attnlab.tokenization import save_tokenizer

log = logging.getLogger(__name__)


def pick_device(preference: str = "auto") -> torch.device:
    """CUDA when present (or asked for), else CPU."""
    if preference == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if preference.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device '{preference}' was requested but CUDA is not available")
    return torch.device(preference)


def pick_dtype(preference: str, device: torch.device) -> torch.dtype:
    """bfloat16 on GPUs, float32 on CPUs, unless the config names one."""
    if preference == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, preference)


def _gguf_location(source: dict, scratch: Path) -> tuple[str, str]:
    """(folder, file name) of the GGUF file a source points at."""
    if "gguf_path" in source:
        path = Path(source["gguf_path"]).expanduser()
        return str(path.parent), path.name
    package = source["gguf_package"]
    if source.get("assemble"):
        # Split packages join their parts through the package's own API.
        module = importlib.import_module(package)
        path = Path(module.assemble(scratch / "model.gguf"))
        return str(path.parent), path.name
    return str(package_folder(package, package)), source["gguf_file"]


@contextmanager
def _gguf_parsed_once():
    """Within this block, each GGUF file is parsed once.

    transformers parses the file for the tokenizer, again for the config and again for the
    weights; a parse walks every metadata field in Python, about 15 s for Gemma-3's 262k
    vocabulary strings. The reader is only read from, so one serves all three.
    """
    import gguf

    original, readers = gguf.GGUFReader, {}

    def reader(path, mode="r"):
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]
    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


def _load_from_gguf(source: dict, scratch: Path):
    folder, name = _gguf_location(source, scratch)
    log.info("loading GGUF %s/%s (dequantized to float32)", folder, name)
    with _gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained: rebuild it without the
    # quantization config and move the dequantized weights over. The rebuilt model's weights
    # are all overwritten (strict), so they are left uninitialised rather than drawn at random
    # (Gemma-3's conversion: 54 s -> 39 s); tying the embeddings is part of that initialisation.
    config = copy.deepcopy(quantized.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.tie_weights()
    model.load_state_dict(quantized.state_dict(), strict=True)
    model.generation_config = quantized.generation_config
    return model, tokenizer


def _load_from_pretrained(source: dict):
    location = source.get("hub") or str(Path(source["local"]).expanduser())
    revision = source.get("revision")
    log.info("loading %s (revision %s)", location, revision or "default")
    tokenizer = AutoTokenizer.from_pretrained(location, revision=revision)
    config = AutoConfig.from_pretrained(location, revision=revision)
    sparse.opened_as_gated(config)  # a shared sparse copy as a source keeps its gates
    model = AutoModelForCausalLM.from_pretrained(location, revision=revision, config=config, dtype="auto")
    return model, tokenizer


def prepare_model(name: str, source: dict, out_dir: str | Path, prompt_format: str | None = None) -> None:
    """Write model ``name`` from ``source`` to ``out_dir`` as safetensors + tokenizer; with
    ``prompt_format: chat``, refuse a tokenizer without a chat template before writing anything.
    With ``ATTNLAB_MODEL_CACHE`` set, a packaged GGUF is converted once and then copied
    (``attnlab.conversion_cache``); parallel preparations of one model wait for its conversion."""
    check_model_source(name, source)
    cached = conversion_cache.cached_folder(name, source)
    if cached is None:
        _convert(name, source, out_dir, prompt_format)
        return
    with conversion_cache.locked(cached):
        if not cached.is_dir():
            _convert(name, source, out_dir, prompt_format)
            conversion_cache.keep(Path(out_dir), cached)
            return
    check_chat_template(name, prompt_format, prepared_has_chat_template(cached))  # its files: no tokenizer loaded
    with atomic_path(out_dir, directory=True) as tmp:
        conversion_cache.copy_folder(cached, tmp)
    log.info("wrote %s: a copy of its conversion kept in %s", out_dir, cached)


def _convert(name: str, source: dict, out_dir: str | Path, prompt_format: str | None) -> None:
    with tempfile.TemporaryDirectory(prefix="attnlab-gguf-") as scratch:
        if "format" in source:  # a released sparse model's checkpoint, converted to GPT-2 with its gate
            from attnlab.released import load_released

            model, tokenizer = load_released(name, source)
        elif "hub" in source or "local" in source:
            model, tokenizer = _load_from_pretrained(source)
        else:
            model, tokenizer = _load_from_gguf(source, Path(scratch))
        check_chat_template(name, prompt_format, bool(tokenizer.chat_template))
        # a hub model whose config was not at hand when the workflow was checked: refused here,
        # before any job reads it, if its family is one the anatomy does not know
        family_of(model.config.get_text_config().model_type, f"model '{name}' ({type(model).__name__})")
        with atomic_path(out_dir, directory=True) as tmp:
            model.save_pretrained(tmp)
            save_tokenizer(tokenizer, tmp)
            provenance = {"name": name, "source": source, "torch": torch.__version__,
                          "transformers": __import__("transformers").__version__}
            if sparse.is_sparse(model):
                provenance["copied_provenance"] = _copy_as_shared(model, name, source, tmp)
            (tmp / "attnlab_source.json").write_text(json.dumps(provenance, indent=2))
            _carry_program_spec(source, tmp)
    log.info("wrote %s", out_dir)


def _copy_as_shared(model, name: str, source: dict, folder: Path) -> dict | None:
    """A sparse copy prepared from another folder stays one that plain transformers refuses, saying
    how to open it (``saved_copy.mark``: save_pretrained drops the config's saved attention), with
    its model card; returns the source folder's provenance (its held-out numbers), if it has one."""
    saved_copy.mark(folder, type(model).__name__)
    found = Path(source["local"]).expanduser() / "attnlab_source.json" if "local" in source else None
    copied = json.loads(found.read_text()) if found is not None and found.is_file() else None
    settings = getattr(model.config.get_text_config(), sparse.CONFIG_KEY)
    summary = {"base": settings.get("base"), "inference_gate_bias": settings.get("gate_bias"),
               **((copied or {}).get("summary") or {})}
    saved_copy.write_card(folder, name, summary)
    return copied


def _carry_program_spec(source: dict, folder: Path) -> None:
    """A compiled-program model's spec (attnlab.groundtruth: its program, blocks and tasks) goes
    with it from a local source into the prepared folder, where its tasks read it."""
    spec = program_spec(source)
    if spec is not None:
        (folder / spec.name).write_bytes(spec.read_bytes())


def load_model(path: str | Path, device: torch.device, dtype: torch.dtype):
    """A prepared model in eval mode; a sparse copy with its gated attention selected (this loader
    registers it: nothing need be imported before). The class comes from the config's own
    family, never from a folder's code (a sparse copy carries some, for plain transformers'
    ``trust_remote_code``: ``attention.saved_copy``)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        config = AutoConfig.from_pretrained(path)
        sparse.opened_as_gated(config)
        model = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].from_pretrained(path, config=config, dtype=dtype)
    except Exception as error:  # noqa: BLE001 -- a damaged folder: name its file and the fix
        problems = damaged_model_files(path)
        if not problems:
            raise
        raise RuntimeError(f"the prepared model folder {path} is damaged: {'; '.join(problems)}. Rebuild "
                           f"it: snakemake -R {path} (with your usual --cores and --configfile), or "
                           f"delete the folder ({type(error).__name__}: {error})") from error
    model = model.to(device)
    sparse.activate(model)
    return model.eval()


def first_hooked_module(model) -> str | None:
    """The name of the first module carrying a forward hook or pre-hook (an intervention such as
    ARM; "" for the model itself), or None: engines that split or reorder a forward leave such
    models alone."""
    return next((name for name, module in model.named_modules()
                 if module._forward_hooks or module._forward_pre_hooks), None)


def left_pad(rows: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Input ids, attention mask and position ids of a left-padded batch.

    Positions count real tokens only, as in generation with left padding, so a
    prompt's result does not depend on the batch it is in.
    """
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.as_tensor(row)
        mask[i, width - len(row):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, positions


def padded_span_mask(lengths: list[int], spans, width: int) -> torch.Tensor:
    """[rows, width] True on each row's token span ``[start, end)``, in left-padded positions."""
    mask = torch.zeros(len(lengths), width, dtype=torch.bool)
    for row, (length, (start, end)) in enumerate(zip(lengths, spans)):
        pad = width - length
        mask[row, pad + start: pad + end] = True
    return mask


def enable_activation_checkpointing(model, options: dict) -> None:
    """Checkpoint ``model``'s blocks with ``options`` (torch.utils.checkpoint's keywords).

    transformers 5.23 names this ``activation_checkpointing_enable`` (``gradient_checkpointing_enable``
    kept as a deprecated alias); 5.17, which GPU images carry, has only the older name."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(options)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)
