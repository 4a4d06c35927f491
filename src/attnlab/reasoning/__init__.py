"""The reasoning stage of arXiv 2510.01032: datasets (``data``), prompts with inserted text
(``prompts``), greedy generation by engine (``generation``, ``decoding``, ``shared_prefix``),
grading and paired comparisons (``grading``, ``paired``). Rules prepare_dataset, make_prompts,
generate, grade, accuracy_table, accuracy_paired.
"""
