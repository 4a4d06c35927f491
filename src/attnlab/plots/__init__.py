"""Every figure: accuracy, length and placement sweeps, MLP histograms (``base``, with the
shared helpers), attention (``attention``), circuits and sparse post-training (``circuits``),
mediation (``mediation``) and the ground truth (``groundtruth``). The plotting rules.
"""
