"""The one error of post-training."""


class SparsifyError(RuntimeError):
    """Post-training cannot start or cannot go on; the message says which key to change."""
