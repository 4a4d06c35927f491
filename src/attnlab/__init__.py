"""attnlab: attention-head experiments on causal language models.

The Snakemake workflow in this repository is a thin layer over this package:
every rule's script makes one call into a module here, and the tests import
the same functions.
"""

__version__ = "0.1.0"
