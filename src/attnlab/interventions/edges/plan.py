"""The plan of a patched pass and its mixing: what each receiver reads from a kept-edges mask
(``Plan``), and the sums that give the receivers of one reading point their inputs (``Mix``,
read as embedding bags over the senders' table)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch

from attnlab.interventions.edges.graph import Graph


@dataclass(eq=False)
class Mix:
    """The inputs of the receivers of one reading point that sum senders, at the patched points:
    receiver i's input is Σ coefs[j] · table[rows[j]] over its ``counts[i]`` entries (the table
    of ``Recording.table``: the senders' (live − corrupted), then the live and the corrupted
    residual): its base with coefficient 1, then its senders' differences, −1 each from the live
    base (the senders it drops) or +1 from the corrupted one (those it keeps)."""

    receivers: list[int]
    rows: torch.Tensor  # long, receiver-major
    coefs: torch.Tensor
    counts: torch.Tensor  # long, per receiver

    def starts(self) -> torch.Tensor:
        """Where each receiver's entries begin in ``rows``."""
        return torch.cumsum(self.counts, 0) - self.counts

    @staticmethod
    def bags(points: int, rows: torch.Tensor, starts: torch.Tensor, coefs: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(indices, offsets, weights) of an embedding bag per point and receiver (point-major:
        the receivers of a point read their rows while they are in cache) over the table viewed
        as [rows · points, hidden], from a mix's ``rows``, ``starts`` and ``coefs`` on the table's
        device (``Plan.on``): computed there, so a pass copies nothing from the host."""
        point = torch.arange(points, device=rows.device)[:, None]
        indices = (rows[None] * points + point).flatten()
        offsets = (point * len(rows) + starts[None]).flatten()
        return indices, offsets, coefs.repeat(points)


@dataclass(frozen=True, eq=False)
class Plan:
    """What each receiver reads, from a kept-edges mask: the live residual minus (live −
    corrupted) of its dropped senders, or the corrupted residual plus (live − corrupted) of its
    kept ones, whichever sums fewer (``base``: force one). Receivers that build on an earlier
    receiver's sum were tried: ~1/3 fewer rows at a circuit's crossing, but slower on a CPU."""

    live_base: torch.Tensor  # [receivers] bool
    patched: torch.Tensor  # [receivers] bool: the receiver does not read the live residual as it is
    mixing: torch.Tensor  # [receivers] bool: it reads a sum of its own (else a base as it is)
    used: torch.Tensor  # [senders] bool: some receiver reads the sender's (live − corrupted)
    mixes: dict[int, Mix]  # by the first receiver of each reading point
    # (device, dtype) -> each mix's (rows, starts, coefs) there: see ``on``
    placed: dict = field(default_factory=dict, compare=False, repr=False)

    def on(self, device, dtype: torch.dtype) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Each mix's (rows, starts, coefs) on ``device``, moved there once per plan in one copy
        per kind: on a GPU a copy from pageable host memory waits for the queued work, and one
        per mix and pass (hundreds) left the card idle between small launches."""
        key = (str(device), dtype)
        if key not in self.placed:
            starts = [mix.starts() for mix in self.mixes.values()]
            flat = [torch.cat(parts) if parts else torch.empty(0, dtype=kind) for parts, kind in (
                ([mix.rows for mix in self.mixes.values()], torch.long), (starts, torch.long),
                ([mix.coefs.to(dtype) for mix in self.mixes.values()], dtype))]
            moved = [part.to(device) for part in flat]
            sizes = [len(mix.rows) for mix in self.mixes.values()], [len(s) for s in starts]
            rows, coefs = moved[0].split(sizes[0]), moved[2].split(sizes[0])
            self.placed[key] = dict(zip(self.mixes, zip(rows, moved[1].split(sizes[1]), coefs)))
        return self.placed[key]

    @property
    def terms(self) -> int:
        """Rows summed per patched point, over every receiver (its base included)."""
        return sum(len(mix.rows) for mix in self.mixes.values())

    @classmethod
    def of(cls, graph: Graph, kept: torch.Tensor, base: str | None = None) -> "Plan":
        valid = _valid(graph)
        if tuple(kept.shape) != valid.shape:
            raise ValueError(f"kept edges: a [senders, receivers] = {valid.shape} mask, not {tuple(kept.shape)}")
        if base not in (None, "live", "corrupted"):
            raise ValueError(f"base: 'live', 'corrupted' or None (whichever sums fewer), not {base!r}")
        kept = kept.bool().cpu().numpy() & valid
        dropped = valid & ~kept
        if base is None:  # on a tie, and where nothing is dropped, the live one
            on_live = dropped.sum(0) <= kept.sum(0)
        else:
            on_live = np.full(graph.n_receivers, base == "live")
        summed = np.where(on_live[None], dropped, kept)  # [senders, receivers]
        mixing = summed.any(0)
        mixes = {}
        for point in graph.reading_points():
            receivers = np.arange(point.start, point.stop)[mixing[point]]
            if len(receivers):
                mixes[point.start] = _mix(graph.n_senders, receivers, on_live, summed)
        patched = ~on_live | mixing  # a live base with nothing dropped reads the live residual as it is
        return cls(*(torch.from_numpy(a) for a in (on_live, patched, mixing, summed.any(1))), mixes)


@functools.lru_cache(maxsize=8)
def _valid(graph: Graph) -> np.ndarray:
    valid = graph.valid().numpy()
    valid.flags.writeable = False
    return valid


def _mix(n_senders: int, receivers: np.ndarray, on_live: np.ndarray, summed: np.ndarray) -> Mix:
    """The entries of ``receivers``' sums (one reading point): base, then senders."""
    which, sender = np.nonzero(summed[:, receivers].T)  # receiver-major
    live = on_live[receivers]
    owner = np.concatenate([np.arange(len(receivers)), which])
    rows = np.concatenate([np.where(live, n_senders, n_senders + 1), sender])
    coefs = np.concatenate([np.ones(len(receivers)), np.where(live[which], -1.0, 1.0)])
    order = np.argsort(owner, kind="stable")  # each receiver's base, then its senders
    return Mix(receivers.tolist(), torch.from_numpy(rows[order]).long(), torch.from_numpy(coefs[order]).float(),
               torch.from_numpy(np.bincount(owner, minlength=len(receivers))).long())
