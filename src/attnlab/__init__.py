"""attnlab: attention-head experiments on causal language models.

The Snakemake workflow in this repository is a thin layer over this package:
every rule's script makes one call into a module here, and the tests import
the same functions.
"""

__version__ = "0.1.0"

import os as _os

# Cluster filesystems (NFS, Lustre) often lack the locks HDF5 takes by default; one
# job writes each file, so locking buys nothing. Must be set before h5py loads.
_os.environ.setdefault("HDF5_USE_FILE_LOCKING", "FALSE")
