"""Head and edge counts: the sweep's grid and curves (``curves``), counts with bootstrap
intervals (``counting``, ``crossing_search``) and the head counts of sparse copies against
density (``head_counts``). Rules sweep_heads, edge_circuit, heads_vs_density, edges_vs_density.
"""
