"""Attention extraction to HDF5: the attention each key receives from later tokens and λ per
layer and head (``extract``), the file format (``h5format``) and its summaries (``analysis``).
Rules extract_attention, lambda_summary, rank_attention_heads and the attention figures.
"""
