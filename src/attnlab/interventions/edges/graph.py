"""The component graph of a decoder model: its senders, receivers and edges, and masks of edges."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from attnlab import anatomy


@dataclass(frozen=True)
class Graph:
    """Senders: embeddings, then per layer its heads and its MLP. Receivers: per layer its query
    heads (q), key/value heads (k, then v) and its MLP, then the logits."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    parallel: bool = False  # a block's MLP reads its input beside the attention (GPT-NeoX): no edge between them

    @classmethod
    def of(cls, model) -> "Graph":
        parts = anatomy.of(model, stages=("edge circuits",))
        return cls(parts.n_layers, parts.n_heads, parts.n_kv_heads, parts.parallel)

    @property
    def n_senders(self) -> int:
        return 1 + self.n_layers * (self.n_heads + 1)

    @property
    def attention_receivers(self) -> int:  # per layer
        return self.n_heads + 2 * self.n_kv_heads

    @property
    def per_layer(self) -> int:
        return self.attention_receivers + 1

    @property
    def n_receivers(self) -> int:
        return self.n_layers * self.per_layer + 1

    def head_sender(self, layer: int, head: int) -> int:
        return 1 + layer * (self.n_heads + 1) + head

    def mlp_sender(self, layer: int) -> int:
        return 1 + layer * (self.n_heads + 1) + self.n_heads

    def attention_slice(self, layer: int) -> slice:
        return slice(layer * self.per_layer, layer * self.per_layer + self.attention_receivers)

    def layer_receivers(self, receiver: int) -> slice:
        """The receivers of ``receiver``'s layer (its query/key/value heads, then its MLP); the
        logits alone."""
        if receiver == self.logits_receiver:
            return slice(receiver, receiver + 1)
        first = receiver - receiver % self.per_layer
        return slice(first, first + self.per_layer)

    def mlp_receiver(self, layer: int) -> int:
        return layer * self.per_layer + self.attention_receivers

    @property
    def logits_receiver(self) -> int:
        return self.n_receivers - 1

    def upstream(self, receiver: int) -> int:
        """How many senders (a prefix of the senders' order) feed ``receiver``."""
        if receiver == self.logits_receiver:
            return self.n_senders
        layer, within = divmod(receiver, self.per_layer)
        before = 1 + layer * (self.n_heads + 1)
        return before + self.n_heads if within == self.attention_receivers and not self.parallel else before

    def reading_points(self) -> list[slice]:
        """The receivers reading each point of the residual stream, in the model's order: each
        layer's query/key/value heads (its input), its MLP (its middle), then the logits."""
        points = []
        for layer in range(self.n_layers):
            mlp = self.mlp_receiver(layer)
            points += [self.attention_slice(layer), slice(mlp, mlp + 1)]
        return points + [slice(self.logits_receiver, self.logits_receiver + 1)]

    def valid(self) -> torch.Tensor:
        """[senders, receivers] bool: which pairs are edges."""
        upstream = torch.tensor([self.upstream(r) for r in range(self.n_receivers)])
        return torch.arange(self.n_senders)[:, None] < upstream[None, :]

    @property
    def n_edges(self) -> int:
        return int(self.valid().sum())

    def sender_names(self) -> list[str]:
        names = ["embed"]
        for layer in range(self.n_layers):
            names += [f"L{layer}.H{head}" for head in range(self.n_heads)] + [f"L{layer}.MLP"]
        return names

    def receiver_names(self) -> list[str]:
        names = []
        for layer in range(self.n_layers):
            names += [f"L{layer}.H{head}.q" for head in range(self.n_heads)]
            names += [f"L{layer}.KV{head}.{kind}" for kind in "kv" for head in range(self.n_kv_heads)]
            names.append(f"L{layer}.MLP")
        return names + ["logits"]

    def edges(self) -> pd.DataFrame:
        """Every edge, sender-major: sender, receiver (indices), their names and layers (the
        embeddings' layer is -1, the logits' the number of layers)."""
        senders, receivers = self.valid().nonzero(as_tuple=True)
        senders, receivers = senders.numpy(), receivers.numpy()
        sender_layer = np.where(senders == 0, -1, (senders - 1) // (self.n_heads + 1))
        receiver_layer = receivers // self.per_layer
        return pd.DataFrame({"sender": senders, "receiver": receivers,
                             "sender_name": np.asarray(self.sender_names())[senders],
                             "receiver_name": np.asarray(self.receiver_names())[receivers],
                             "sender_layer": sender_layer, "receiver_layer": receiver_layer})

    def mask(self, senders: np.ndarray, receivers: np.ndarray) -> torch.Tensor:
        """[senders, receivers] bool with the given edges set."""
        mask = torch.zeros(self.n_senders, self.n_receivers, dtype=torch.bool)
        rows, columns = (torch.tensor(np.asarray(index), dtype=torch.long) for index in (senders, receivers))
        mask[rows, columns] = True
        return mask
