"""A float64 forward of the tiny decoders written here from their weights, in which every receiver
reads its own input (the edge-circuit reference of test_edges_references.py).

It runs a tiny Llama, Qwen2, Gemma-3 (sandwich norms, per-head q/k norms, sliding window), GPT-2
(fused c_attn stored [in, out], learned positions, LayerNorms with biases, a plain GELU MLP,
output-projection biases), OLMo (LayerNorms without parameters; its q, k and v clamped to ±clip_qkv where the config sets
it) or OLMo-2 (no pre-norms: RMS
post-norms after each sublayer; q/k norms over every head at once) without the model's modules,
keeping every sender's contribution to the residual stream (the embeddings with any learned
positions, each head's output-projection slice, times a post-attention norm's scale of the whole
block output, each MLP's output, after any post-feedforward norm) and giving every receiver its
own input: each query head, key/value head, MLP and the logits reads the sum of its upstream
senders, each taken from the live pass or from a corrupted run as a kept-edges mask says, plus
the output-projection biases of the blocks below it (no sender's: the same in every run) and an
optional shift of its own (finite differences, gradients). Its pre-norm is applied to that sum
alone; a query/key norm over every head normalises the whole projection of the head's own input,
of which the head keeps its slice. A sparse copy's heads gate the softmax weights with
1[s + b > 0], not renormalised; in training (``training``), with the straight-through gate
1[s + b > 0] + σ(s + b) − stopgrad(σ(s + b)) (the sampled gate with its logistic noise at 0), and
the expected density Σ σ(s + b) over the allowed edges of every layer and head, over their count. Nothing here goes through ``attnlab`` but the ``Graph``'s
numbering of senders and receivers.
"""

import torch

from attnlab.interventions.edges import Graph
from attnlab.patching.heads import TaskBatch


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def _linear(module, x: torch.Tensor, transposed: bool = False) -> torch.Tensor:
    """x W^T + b (``transposed``: GPT-2's Conv1D, x W + b)."""
    weight = module.weight.double()
    out = x @ (weight if transposed else weight.T)
    return out if module.bias is None else out + module.bias.double()


class HandForward:
    """The forward of the module docstring; ``gate_bias``: a sparse copy's deterministic gate."""

    def __init__(self, model, gate_bias: float | None = None, training: bool = False):
        self.model, self.gate_bias, self.training = model, gate_bias, training
        self.expected: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer: (Σ σ(s + b), edges)
        config = model.config
        self.kind = config.model_type  # llama, qwen2, qwen3, mistral, gemma3_text, gpt2, olmo, olmo2
        self.graph = Graph.of(model)
        self.gpt2 = self.kind == "gpt2"
        self.neox = self.kind == "gpt_neox"  # parallel blocks; each head's q, k, v side by side
        self.gemma = self.kind in ("gemma3_text", "gemma2")  # RMS norms scale by 1 + w; sandwich norms
        self.head_norms = self.kind in ("gemma3_text", "qwen3")  # q/k RMS norms per head, before rope
        # Mistral-style configs: one window on every layer, set on the config, not the module
        self.window = config.sliding_window if self.kind in ("mistral", "phi3") else None
        self.phi3 = self.kind == "phi3"  # fused qkv_proj (q, k, v heads stacked) and gate_up_proj
        if self.gpt2:
            self.layers, self.final = model.transformer.h, model.transformer.ln_f
        elif self.neox:
            self.layers, self.final = model.gpt_neox.layers, model.gpt_neox.final_layer_norm
        else:
            self.layers, self.final = model.model.layers, model.model.norm
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = config.hidden_size // self.heads if self.gpt2 or self.neox else config.head_dim
        # Gemma-2: attention scores and final logits soft-capped, tanh(s / c) · c
        self.attention_cap = getattr(config, "attn_logit_softcapping", None)
        self.final_cap = getattr(config, "final_logit_softcapping", None)
        self.clip = getattr(config, "clip_qkv", None)  # OLMo's clamp of every q, k and v

    # ---- pieces ----
    def norm(self, module, x: torch.Tensor) -> torch.Tensor:
        """A norm from its parameters: RMS x · rsqrt(mean(x²) + eps) · w (Gemma-3: · (1 + w));
        GPT-2's LayerNorm (x − mean) · rsqrt(var + eps) · w + b; OLMo's the same without w, b."""
        if self.gpt2 or self.neox or self.kind == "olmo":
            x = x - x.mean(-1, keepdim=True)
            out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + (1e-5 if self.kind == "olmo" else module.eps))
            return out if self.kind == "olmo" else out * module.weight.double() + module.bias.double()
        return x * self.rms_scale(module, x)

    def rms_scale(self, module, x: torch.Tensor) -> torch.Tensor:
        """rsqrt(mean(x²) + eps) · w of an RMS norm (Gemma-3: · (1 + w))."""
        eps = module.eps if hasattr(module, "eps") else module.variance_epsilon
        weight = module.weight.double() + (1.0 if self.gemma else 0.0)
        return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    def block_parts(self, layer):
        """(attention, pre-norm of the attention, post-norm of it, pre-norm of the MLP, post-norm
        of it, the MLP) of a block, None where it has none."""
        if self.gpt2:
            return layer.attn, layer.ln_1, None, layer.ln_2, None, layer.mlp
        if self.neox:  # both pre-norms read the block's input (the graph gives the MLP no same-layer heads)
            return layer.attention, layer.input_layernorm, None, layer.post_attention_layernorm, None, layer.mlp
        if self.gemma:
            return (layer.self_attn, layer.input_layernorm, layer.post_attention_layernorm,
                    layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm, layer.mlp)
        if self.kind == "olmo2":
            return layer.self_attn, None, layer.post_attention_layernorm, None, layer.post_feedforward_layernorm, layer.mlp
        return layer.self_attn, layer.input_layernorm, None, layer.post_attention_layernorm, None, layer.mlp

    def rope(self, layer: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [rows, 1, tokens, head_dim] of the layer's rotary embedding."""
        parameters = self.model.config.rope_parameters
        if self.kind == "gemma3_text":  # one rope per layer kind
            parameters = parameters[self.model.config.layer_types[layer]]
        assert parameters["rope_type"] == "default"
        rotated = int(self.head_dim * parameters.get("partial_rotary_factor", 1.0))  # the first dims rotate
        exponents = torch.arange(0, rotated, 2, dtype=torch.float64) / rotated
        inverse = 1.0 / parameters["rope_theta"] ** exponents
        angles = positions.double()[..., None] * inverse
        angles = torch.cat([angles, angles], dim=-1)[:, None]
        return angles.cos(), angles.sin()

    def attend(self, attention, q, k, v, mask: torch.Tensor) -> torch.Tensor:
        """Causal (sliding-window, padding-masked) attention [rows, heads, tokens, head_dim]; a
        sparse copy multiplies the softmax weights by 1[s + b > 0] without renormalising."""
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        logits = q @ k.transpose(-1, -2) * attention.scaling
        if self.attention_cap is not None:  # the gates read the capped scores too
            logits = torch.tanh(logits / self.attention_cap) * self.attention_cap
        tokens = logits.shape[-1]
        query, key = torch.arange(tokens)[:, None], torch.arange(tokens)[None, :]
        allowed = (key <= query) & mask.bool()[:, None, None, :]
        window = getattr(attention, "sliding_window", None) or self.window
        if window is not None:
            allowed = allowed & (query - key < window)
        # a finite fill: a padded query with no key to read gets a uniform row, not NaN
        weights = logits.masked_fill(~allowed, torch.finfo(torch.float64).min).softmax(-1)
        if self.gate_bias is not None and self.training:
            expected = torch.sigmoid(logits + self.gate_bias)
            allowed = allowed.expand_as(expected)
            self.expected.append(((expected * allowed).sum(), allowed.sum()))
            weights = weights * ((logits + self.gate_bias > 0) + expected - expected.detach())
        elif self.gate_bias is not None:
            weights = weights * (logits + self.gate_bias > 0)
        return weights @ v

    def expected_density(self) -> torch.Tensor:
        """The expected density of the last forward (``training``)."""
        return sum(total for total, _ in self.expected) / sum(count for _, count in self.expected)

    def projections(self, attention):
        """Per kind ("q", "k", "v"): a function of a normed input [rows, tokens, d] giving every
        head's projection [rows, tokens, heads · e], after a q/k norm over every head at once."""
        if self.gpt2:
            width = self.heads * self.head_dim
            return {kind: (lambda x, i=i: _linear(attention.c_attn, x, transposed=True)[..., i * width:(i + 1) * width])
                    for i, kind in enumerate("qkv")}
        if self.neox:  # rows: head by head, its q, k and v side by side
            e = self.head_dim
            split = lambda x, part: _linear(attention.query_key_value, x).unflatten(-1, (self.heads, 3 * e))[  # noqa: E731
                ..., part * e:(part + 1) * e].flatten(-2)
            return {kind: (lambda x, part=part: split(x, part)) for part, kind in enumerate("qkv")}
        if self.phi3:  # rows: every query head, then every key head, then every value head
            q_width, kv_width = self.heads * self.head_dim, self.kv_heads * self.head_dim
            cuts = {"q": (0, q_width), "k": (q_width, q_width + kv_width), "v": (q_width + kv_width, q_width + 2 * kv_width)}
            return {kind: (lambda x, a=a, b=b: _linear(attention.qkv_proj, x)[..., a:b]) for kind, (a, b) in cuts.items()}
        whole = {"q": attention.q_proj, "k": attention.k_proj, "v": attention.v_proj}
        if self.kind == "olmo2":  # q_norm, k_norm over every head's projection at once
            return {kind: (lambda x, p=p, n=getattr(attention, f"{kind}_norm", None):
                           _linear(p, x) if n is None else self.norm(n, _linear(p, x))) for kind, p in whole.items()}
        if self.clip is not None:
            return {kind: (lambda x, p=p: _linear(p, x).clamp(-self.clip, self.clip)) for kind, p in whole.items()}
        return {kind: (lambda x, p=p: _linear(p, x)) for kind, p in whole.items()}

    def mlp(self, mlp, x: torch.Tensor) -> torch.Tensor:
        if self.gpt2:
            return _linear(mlp.c_proj, mlp.act(_linear(mlp.c_fc, x, transposed=True)), transposed=True)
        if self.neox:
            return _linear(mlp.dense_4h_to_h, mlp.act(_linear(mlp.dense_h_to_4h, x)))
        if self.phi3:
            gate, up = _linear(mlp.gate_up_proj, x).chunk(2, dim=-1)
            return _linear(mlp.down_proj, mlp.activation_fn(gate) * up)
        return _linear(mlp.down_proj, mlp.act_fn(_linear(mlp.gate_proj, x)) * _linear(mlp.up_proj, x))

    def out_weight(self, attention) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The output projection's weight [hidden, heads, e] and its bias."""
        projection = attention.c_proj if self.gpt2 else attention.dense if self.neox else attention.o_proj
        weight = projection.weight.double()
        weight = weight.T if self.gpt2 else weight
        return weight.view(-1, self.heads, self.head_dim), None if projection.bias is None else projection.bias.double()

    # ---- the forward ----
    def forward(self, embeds: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                kept: torch.Tensor | None = None, corrupted: list | None = None,
                shifts: torch.Tensor | dict | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(logits, every sender's contribution [rows, tokens, hidden] in the graph's order).
        Receiver r reads Σ over its upstream senders s of the live contribution where
        ``kept[s, r]`` (or ``kept`` is None), else ``corrupted[s]`` (a float ``kept``: w · live +
        (1 − w) · corrupted), plus the constant biases below it, plus ``shifts[r]``."""
        graph = self.graph
        self.expected = []
        if self.gpt2:  # learned positions join the token embeddings: the embeddings' sender
            embeds = embeds.double() + self.model.transformer.wpe(positions).double()
        senders, constants = [embeds.double()], []  # constants: the output-projection biases so far

        def read(receiver: int) -> torch.Tensor:
            total = sum(constants) if constants else 0
            for sender in range(graph.upstream(receiver)):
                if kept is not None and kept.dtype != torch.bool:  # a weight: w live + (1 − w) corrupted
                    weight = kept[sender, receiver]
                    total = total + weight * senders[sender] + (1 - weight) * corrupted[sender]
                    continue
                use_live = kept is None or bool(kept[sender, receiver])
                total = total + (senders[sender] if use_live else corrupted[sender])
            if shifts is not None and (not isinstance(shifts, dict) or receiver in shifts):
                total = total + shifts[receiver]
            return total

        for index, layer in enumerate(self.layers):
            self._layer(index, layer, read, senders, constants, mask, positions)
        assert len(senders) == graph.n_senders
        x = self.norm(self.final, read(graph.logits_receiver))
        logits = x @ self.model.get_output_embeddings().weight.double().T
        if self.final_cap is not None:
            logits = torch.tanh(logits / self.final_cap) * self.final_cap
        return logits, senders

    def _layer(self, index, layer, read, senders, constants, mask, positions) -> None:
        """One block: its heads' and its MLP's contributions appended to ``senders``."""
        attention, pre, post, mlp_pre, mlp_post, mlp = self.block_parts(layer)
        first, h, g, e = self.graph.attention_slice(index).start, self.heads, self.kv_heads, self.head_dim
        project = self.projections(attention)

        def heads_of(kind: str, offset: int, count: int) -> torch.Tensor:
            """Each of ``count`` heads' slice of the ``kind`` projection of its own receiver's
            normed input: [rows, count, tokens, e]."""
            outs = []
            for head in range(count):
                x = read(first + offset + head)
                whole = project[kind](x if pre is None else self.norm(pre, x))
                outs.append(whole[..., head * e:(head + 1) * e])
            return torch.stack(outs, dim=1)

        q, k, v = heads_of("q", 0, h), heads_of("k", h, g), heads_of("v", h + g, g)
        if self.head_norms:  # per-head q/k norms
            q, k = self.norm(attention.q_norm, q), self.norm(attention.k_norm, k)
        if not self.gpt2:
            cos, sin = self.rope(index, positions)
            r = cos.shape[-1]  # partial rotary: the dimensions after r pass unrotated
            q = torch.cat([q[..., :r] * cos + _rotate_half(q[..., :r]) * sin, q[..., r:]], dim=-1)
            k = torch.cat([k[..., :r] * cos + _rotate_half(k[..., :r]) * sin, k[..., r:]], dim=-1)
        z = self.attend(attention, q, k, v, mask)  # [rows, heads, tokens, e]
        weight, bias = self.out_weight(attention)
        contributions = torch.einsum("bhte,dhe->hbtd", z, weight)
        if post is not None:  # the post-norm's scale of the block's whole output, the same for every head
            contributions = contributions * self.rms_scale(post, contributions.sum(0))
        senders += list(contributions)
        if bias is not None and not self.neox:  # a parallel block's MLP reads the block's input
            constants.append(bias)
        x = read(self.graph.mlp_receiver(index))
        if bias is not None and self.neox:
            constants.append(bias)
        out = self.mlp(mlp, x if mlp_pre is None else self.norm(mlp_pre, x))
        senders.append(out if mlp_post is None else self.norm(mlp_post, out))

    def run(self, batch: TaskBatch, ids: torch.Tensor | None = None, embeds: torch.Tensor | None = None,
            **patch) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(the metric of every prompt, the senders) of ``ids`` (or ``embeds``) of ``batch``."""
        if embeds is None:
            embeds = self.model.get_input_embeddings()(ids)
        logits, senders = self.forward(embeds, batch.mask, batch.positions, **patch)
        return batch.metric(logits, slice(0, batch.n_prompts)), senders
