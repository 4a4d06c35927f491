"""The attention function attnlab registers with transformers and what it computes inside a
forward: eager attention blocks with a sparse copy's edge gates (``function``, ``sparse``), the
per-layer reduction to received attention and λ (``reduction``), and the fused Triton kernels on
GPUs (``fused``, ``kernels``). Below every intervention; every model-running rule goes through it.
"""
