"""The recording of one forward: every sender's contribution and the residual stream at every
receiver's point, kept for the passes patched against it."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class Recording:
    """One forward's sender contributions [senders, points, hidden] and the residual stream at
    each receiver's point [points, hidden]: each layer's input, its MLP's input (``middle``) and
    the final norm's input. Points are the tokens of the pass flattened (row × tokens + position),
    all of them or only ``points``: where the passes patched against this recording may differ
    from it. A causal model computes the same at every token before a prompt's first difference
    between its clean and corrupted ids, so those tokens read the live residual as it is."""

    points: torch.Tensor | None = None  # flat token indices; None: every token
    shape: tuple[int, int] | None = None  # (rows, tokens) of the recorded pass
    # whether to keep the outputs at the tokens not in ``points`` (``elsewhere``): only passes
    # patched against this recording read them, not edge attribution's differences
    keeps_elsewhere: bool = True
    senders: torch.Tensor | None = None
    layer_inputs: dict[int, torch.Tensor] = field(default_factory=dict)
    middle: dict[int, torch.Tensor] = field(default_factory=dict)
    final: torch.Tensor | None = None
    head_inputs: dict[int, torch.Tensor] = field(default_factory=dict)  # o_proj's input [points, heads · e]
    attention_outputs: dict[int, torch.Tensor] = field(default_factory=dict)  # o_proj's output [points, hidden]
    # the outputs of each layer's q/k/v/o projections and MLP at the tokens not in ``points``
    # [tokens, features], where every pass patched against this recording computes the same
    elsewhere: dict[tuple, torch.Tensor] = field(default_factory=dict)
    # what the passes patched against this recording sum receivers' inputs from, [senders + 2,
    # points, hidden] (``Mix``): each sender's (live − corrupted), then the live and the corrupted
    # residual at the reading point under way. One buffer reused from pass to pass: a pass writes
    # every row it reads before reading it
    table: torch.Tensor | None = None
    unpatched_on: dict = field(default_factory=dict, repr=False)  # device -> ``unpatched``'s indices

    def unpatched(self, device) -> torch.Tensor:
        """The flat indices of the tokens not in ``points`` (``points`` and ``shape`` set), found
        once per device (``nonzero`` waits for a GPU's queued work)."""
        key = str(device)
        if key not in self.unpatched_on:
            other = torch.ones(int(np.prod(self.shape)), dtype=torch.bool, device=device)
            other[self.points.to(device)] = False
            self.unpatched_on[key] = other.nonzero()[:, 0]
        return self.unpatched_on[key]
