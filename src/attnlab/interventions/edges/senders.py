"""The senders' side of a patched pass: the hooks that record what each sender (the embeddings,
every head, every MLP) writes into the residual stream and write its (live − corrupted) into the
senders' table where some receiver reads it. A head's contribution is its slice of o_proj: its
difference is W_O,h (z_h − corrupted z_h), computed from o_proj's inputs."""

from __future__ import annotations

import torch
from torch import nn

from attnlab import anatomy
from attnlab.interventions.edges.points import select_points
from attnlab.interventions.edges.state import PassState


class SenderHooks:
    """Forward hooks of one installed patch that keep the senders' contributions."""

    def __init__(self, state: PassState):
        self.state = state

    def write(self, index: int, value: torch.Tensor) -> None:
        """Sender ``index`` wrote ``value`` [rows, tokens, hidden] (or several: [n, rows, ...])."""
        state = self.state
        values = value if value.dim() == 4 else value[None]
        record = state.patch.record
        if record is not None:
            if record.senders is None:
                record.senders = values.new_empty(state.graph.n_senders,
                                                  *select_points(values[0], record.points).shape)
            record.senders[index:index + len(values)] = select_points(values.detach(), record.points)
        self.write_patched(index, len(values), lambda: select_points(values, state.points))

    def write_patched(self, index: int, count: int, current) -> None:
        """Senders ``index`` to ``index + count`` wrote ``current()`` [count, points, hidden] at the
        patched points: keep their (live − corrupted) where some receiver reads it."""
        state = self.state
        if state.plan is None or not bool(state.plan.used[index:index + count].any()):  # never read
            return
        if state.weighted:
            self.keep_differences(index, current() - state.patch.corrupted.senders[index:index + count])
            return
        torch.sub(current(), state.patch.corrupted.senders[index:index + count],
                  out=state.table()[index:index + count])

    def keep_differences(self, first: int, differences: torch.Tensor) -> None:
        """Senders ``first`` on wrote ``differences`` [count, points, hidden] (live − corrupted),
        kept as they are (with autograd's graph) for the weighted sums."""
        for offset, difference in enumerate(differences):
            self.state.differences[first + offset] = difference

    def write_head_differences(self, o_proj: nn.Module, first: int, z: torch.Tensor,
                               corrupted_z: torch.Tensor) -> None:
        """The heads' (live − corrupted) from o_proj's inputs at the patched points, ``z`` and
        ``corrupted_z`` [points, heads · e]: W_O,h (z_h − corrupted z_h), written straight into
        the table (one product instead of a product and a difference; with edge weights, kept
        out of place). Returns them [heads, points, hidden]."""
        n_heads = self.state.graph.n_heads
        difference = (z - corrupted_z).view(len(z), n_heads, -1).transpose(0, 1)  # [heads, points, e]
        weight = anatomy.heads_out(o_proj, n_heads)  # [heads, e, hidden]
        if self.state.weighted:
            differences = torch.bmm(difference, weight.to(difference.dtype))
            self.keep_differences(first, differences)
            return differences
        return torch.bmm(difference, weight.to(difference.dtype), out=self.state.table()[first:first + n_heads])

    def heads(self, index: int, scale: anatomy.NormSpec | None):
        """The forward hook on layer ``index``'s output projection (its stand-in) that keeps its
        heads' contributions; ``scale``: a post-norm of the attention block's output (RMS)."""
        state = self.state
        n_heads = state.graph.n_heads
        first = state.graph.head_sender(index, 0)

        def hook(module, args, output):
            unread = state.plan is None or not bool(state.plan.used[first:first + n_heads].any())
            if state.patch.record is None and unread:
                return
            z = args[0]  # o_proj's input, the heads' outputs side by side; a bias is no sender's
            module = module.module  # the o_proj the stand-in runs
            record = state.patch.record
            if record is not None:  # recorded: no graph (a recording pass may be taking gradients)
                if scale is None:  # the heads' differences are linear in o_proj's input
                    record.head_inputs[index] = select_points(z.detach(), record.points)
                    record.attention_outputs[index] = select_points(output.detach(), record.points)
                self.write(first, self.head_outputs(module, z.detach(), output.detach(), scale))
            elif index in state.heads_written:
                return
            elif scale is None and index in state.patch.corrupted.head_inputs:  # only patched points are read
                self.write_head_differences(module, first, select_points(z, state.points),
                                            state.patch.corrupted.head_inputs[index])
            else:
                self.write_patched(first, n_heads, lambda: self.head_outputs(
                    module, select_points(z, state.points), select_points(output, state.points), scale))
        return hook

    def attention_output(self, index: int, o_proj: nn.Module, z: torch.Tensor) -> torch.Tensor:
        """o_proj's output at the patched points from its input there, ``z`` [points, heads · e].
        Where some receiver reads the heads' differences, they are computed first (into the
        table) and the output is the corrupted run's plus their sum: o_proj's product, once."""
        state = self.state
        first, n_heads, corrupted = state.graph.head_sender(index, 0), state.graph.n_heads, state.patch.corrupted
        if not bool(state.plan.used[first:first + n_heads].any()) or index not in corrupted.attention_outputs:
            return o_proj(z)
        differences = self.write_head_differences(o_proj, first, z, corrupted.head_inputs[index])
        state.heads_written.add(index)
        if state.weighted:
            return differences.sum(0) + corrupted.attention_outputs[index]
        return torch.sum(differences, 0).add_(corrupted.attention_outputs[index])

    def head_outputs(self, o_proj: nn.Module, z: torch.Tensor, output: torch.Tensor,
                     scale: anatomy.NormSpec | None) -> torch.Tensor:
        """Each head's contribution [heads, ..., hidden] from the output projection's input ``z``
        [..., heads · e] and output ``output`` [..., hidden] (a bias is no head's)."""
        n_heads = self.state.graph.n_heads
        heads = torch.einsum("...he,hed->h...d", z.view(*z.shape[:-1], n_heads, -1), anatomy.heads_out(o_proj, n_heads))
        if scale is not None:  # a post-norm of the block's output: the same scale for every head
            _, inverse = scale.normalise(output)
            heads = heads * (inverse * scale.weight)
        return heads

    def mlp_output(self, index: int):
        """The forward hook on layer ``index``'s MLP output (its post-norm, where it has one)."""
        def hook(module, args, output):
            self.write(self.state.graph.mlp_sender(index), output)
        return hook
