"""The receivers' side of a patched pass: the hooks at each point of the residual stream that
receivers read (each layer's input, its MLP's pre-norm, the final norm). They record the
residual there, compute the inputs of the receivers that do not read it as it is (``Plan``:
embedding bags over the senders' table), and keep the MLPs' and the logits' input gradients."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from attnlab.interventions.edges.plan import Mix
from attnlab.interventions.edges.points import select_points
from attnlab.interventions.edges.senders import SenderHooks
from attnlab.interventions.edges.state import GroupInputs, PassState


class ReceiverHooks:
    """Forward hooks of one installed patch at the receivers' reading points."""

    def __init__(self, state: PassState, senders: SenderHooks):
        self.state, self.senders = state, senders

    # ---- the hooks ----
    def layer_input(self, index: int):
        """The forward pre-hook of decoder layer ``index``: its input is the query/key/value
        heads' reading point (their own inputs go to the projections' stand-ins); layer 0's is
        also the embeddings' sender."""
        state = self.state

        def hook(module, args, kwargs):
            live = args[0] if args else kwargs["hidden_states"]
            # before anything reads the recording's points (the embeddings' sender does): on a
            # smaller batch they would index past its tokens
            if index == 0 and state.plan is not None and state.patch.corrupted.shape != tuple(live.shape[:2]):
                raise ValueError(f"edge patching: this pass runs {tuple(live.shape[:2])} [rows, tokens], the "
                                 f"corrupted recording {state.patch.corrupted.shape}: record the corrupted run "
                                 "of the same batch of prompts")
            replaced = self._start_pass(live) if index == 0 else None
            if replaced is not None:
                live = replaced
            self._keep_layer_input(index, live)
            corrupted = state.patch.corrupted.layer_inputs[index] if state.plan is not None else None
            inputs = self._group_inputs(state.graph.attention_slice(index), live, corrupted)
            if inputs is not None:
                state.attention_inputs[index] = inputs
            if replaced is None:
                return None
            if args:
                return (replaced, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": replaced}
        return hook

    def mlp_input(self, index: int):
        """The forward hook of layer ``index``'s pre-norm of the MLP: the MLP's reading point."""
        state = self.state

        def hook(module, args, output):
            live = args[0]
            if state.patch.record is not None:
                state.patch.record.middle[index] = select_points(live.detach(), state.patch.record.points)
            state.attention_inputs.pop(index, None)  # the layer's heads are done with theirs
            receiver = state.graph.mlp_receiver(index)
            corrupted = state.patch.corrupted.middle[index] if state.plan is not None else None
            return self._lone_receiver(module, receiver, live, output, corrupted)
        return hook

    def final(self):
        """The forward hook of the final norm: the logits' reading point."""
        state = self.state

        def hook(module, args, output):
            live = args[0]
            if state.patch.record is not None:
                state.patch.record.final = select_points(live.detach(), state.patch.record.points)
            corrupted = state.patch.corrupted.final if state.plan is not None else None
            return self._lone_receiver(module, state.graph.logits_receiver, live, output, corrupted)
        return hook

    # ---- the first layer's input ----
    def _start_pass(self, live: torch.Tensor) -> torch.Tensor | None:
        """A pass begins: forget the last one's, and write the embeddings (sender 0). Where
        receiver gradients are asked for and the input carries no graph, it is replaced by a leaf
        that does, which is returned (else None)."""
        state, replaced = self.state, None
        state.clear()
        if state.patch.gradients is not None and torch.is_grad_enabled() and not live.requires_grad:
            live = replaced = live.detach().requires_grad_(True)  # a graph to take gradients on
        self.senders.write(0, live)
        return replaced

    def _keep_layer_input(self, index: int, live: torch.Tensor) -> None:
        """Keep layer ``index``'s input: for the query/key/value heads' gradients, and in the
        recording (with the pass's [rows, tokens] at layer 0)."""
        state = self.state
        if state.patch.gradients is not None:
            state.live_inputs[index] = live
        record = state.patch.record
        if record is not None:
            if index == 0:
                record.shape = tuple(live.shape[:2])
            record.layer_inputs[index] = select_points(live.detach(), record.points)

    # ---- receivers' inputs ----
    def _group_inputs(self, receivers: slice, live: torch.Tensor, corrupted: torch.Tensor | None
                      ) -> GroupInputs | None:
        """What ``receivers``, one reading point's, read at the patched points, where the live
        residual stream is ``live`` [rows, tokens, hidden] and the corrupted run's ``corrupted``
        [points, hidden]; None where every one reads ``live`` as it is."""
        plan = self.state.plan
        if plan is None or not bool(plan.patched[receivers].any()):
            return None
        mix = plan.mixes.get(receivers.start)
        mixed = None if mix is None else self._mixed(receivers.start, mix, live, corrupted)
        mixed_at = [] if mix is None else [receiver - receivers.start for receiver in mix.receivers]
        as_corrupted = plan.patched[receivers] & ~plan.mixing[receivers]  # nothing kept
        return GroupInputs(mixed, mixed_at, corrupted, as_corrupted.nonzero()[:, 0].tolist())

    def _lone_receiver(self, module: nn.Module, receiver: int, live: torch.Tensor, output: torch.Tensor,
                       corrupted: torch.Tensor | None) -> torch.Tensor | None:
        """The output of the pre-norm ``module`` of a lone receiver (an MLP, the logits) on its own
        input, given its ``output`` on the ``live`` residual; None where it reads ``live`` as it
        is and no gradient is asked for."""
        state = self.state
        group = self._group_inputs(slice(receiver, receiver + 1), live, corrupted)
        if group is not None:  # forward: not this hook again
            own = group.corrupted if group.mixed is None else group.mixed[0]
            return state.at_points(output, module.forward(own), output.clone)
        gradients = state.patch.gradients
        if gradients is None or not live.requires_grad:
            return None
        own = live.view_as(live)  # its gradient is the part that flows through this norm alone
        layer = state.graph.layer_receivers(receiver)
        within = slice(receiver - layer.start, receiver - layer.start + 1)
        own.register_hook(lambda grad: gradients.add(layer.start, layer.stop - layer.start, within,
                                                     gradients.at_points(grad)[None]))
        return module.forward(own)

    def _mixed(self, point: int, mix: Mix, live: torch.Tensor, corrupted: torch.Tensor) -> torch.Tensor:
        """The inputs [receivers, points, hidden] of ``mix``'s receivers: an embedding bag per
        point and receiver over the table, reading only the rows each one sums (a dense product
        over every sender some receiver of the point sums costs ~4x the flops at a circuit's
        crossing and runs only ~2x faster per flop on a CPU)."""
        state = self.state
        if state.weighted:
            return self._weighted(mix, corrupted)
        table, base = state.table(), state.graph.n_senders
        table[base].copy_(select_points(live, state.points))
        table[base + 1].copy_(corrupted)
        points, hidden = table.shape[1:]
        indices, offsets, weights = Mix.bags(points, *state.plan.on(table.device, table.dtype)[point])
        inputs = F.embedding_bag(indices, table.view(-1, hidden), offsets, mode="sum", per_sample_weights=weights)
        return inputs.view(points, len(mix.receivers), hidden).transpose(0, 1)

    def _weighted(self, mix: Mix, corrupted: torch.Tensor) -> torch.Tensor:
        """With edge weights w: the inputs [receivers, points, hidden] of ``mix``'s receivers, the
        corrupted residual plus Σ_s w[s, r] (live − corrupted)_s over their upstream senders (one
        reading point's receivers share them), differentiable in w and in the differences."""
        state = self.state
        upstream = state.graph.upstream(mix.receivers[-1])
        differences = torch.stack([state.differences[sender] for sender in range(upstream)])  # [U, points, hidden]
        weights = state.patch.weights[:upstream, mix.receivers].to(differences.device, differences.dtype)
        return corrupted[None] + torch.einsum("ur,uph->rph", weights, differences)
