"""Fused attention kernels (Triton): dense or edge-gated attention, the received-attention
reduction and the gated attention's backward pass, blockwise, without queries × keys tensors.

They serve the attention function of ``attnlab.interventions`` on GPUs (``attnlab.attention.fused`` decides
when); on CPUs the eager blocks stay. Tests run them on CPU tensors in Triton's interpreter
(``TRITON_INTERPRET=1``, set before this package's kernels are first imported).
"""
