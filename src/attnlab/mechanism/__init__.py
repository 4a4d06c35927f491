"""What carries a condition's effect: MLP activation recording (``recording``) and mediation
between two prompt conditions (``mediation``). Rules mlp_activations, mlp_summary, mediate.
"""
