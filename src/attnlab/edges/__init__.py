"""The component graph of a decoder model, and the part of ``intervened`` that patches its edges.

Senders write into the residual stream: the token embeddings, every attention head (its slice of
o_proj: under grouped-query attention still one per query head) and every MLP. Receivers read it:
every query head's query input, every key/value head's key and value inputs, every MLP's input
and the logits (the final norm's input). One edge is one sender feeding one later receiver; a
receiver's input is the sum of what its upstream senders wrote.

``EdgePatch`` is what ``intervened(model, edges=...)`` installs. Each receiver is given its own
input, computed from per-sender activations rather than from the one residual stream the model
carries:

- ``record``: keep every sender's contribution and the residual stream at every receiver's
  point (the clean and the corrupted runs);
- ``kept`` (with the corrupted run's ``Recording``): every edge not kept carries the sender's
  corrupted activation into its receiver, a kept one the sender's activation in this pass; each
  receiver sees its own mix, and its pre-norm is applied to that mix;
- ``gradients``: each backward pass adds the gradient of the metric with respect to every
  receiver's input (edge attribution). Receivers reading the live residual as it is are not
  given inputs of their own: a query/key/value head's gradient is its slice of the projection's
  output gradient taken back through the layer's RMS pre-norm (one vector-Jacobian product for
  all heads), an MLP's or the logits' the gradient that reaches its pre-norm's input.

A receiver's input is computed from whichever side it keeps less of (``Plan``): the live
residual minus (live − corrupted) of its dropped senders, or the corrupted residual plus
(live − corrupted) of its kept ones, summed by an embedding bag per token and receiver that
reads only those rows of a table holding the senders' differences and the two bases (``Mix``).
So all edges kept is the unpatched forward to the last bit (nothing is touched) and no edge kept
is the corrupted forward to float rounding (each receiver reads the corrupted residual itself).
Only the layer under way holds its receivers' inputs, and only at the tokens the corrupted
``Recording`` keeps: from each prompt's first clean/corrupted difference on. Before it every
pass computes what the corrupted run computed, so a patching pass runs the layers' q/k/v/o
projections and MLPs only at the patched tokens and takes their outputs elsewhere from the
recording. Receivers that read a base as it is share one projection of it; a mixed
query/key/value head's RMS pre-norm (its weight read from the module) is folded into its
projection. The heads' differences are W_O,h (z_h − corrupted z_h) from o_proj's inputs, and
o_proj's output at the patched tokens the corrupted run's plus their sum (without a post-norm
of the attention block: with one, each head's output is scaled by it and subtracted).

Post-norms that rescale a block's output before it joins the residual (Gemma-3's
post_attention_layernorm and post_feedforward_layernorm) are RMS norms: a head's contribution is
its o_proj slice times the norm's scale of the block's whole output, so the heads' contributions
still add up to what the layer adds. Architectures whose layers lack these parts are refused.

The modules, each below the ones that use it:

- ``graph``: the senders, receivers and edges (``Graph``), the edges table and masks;
- ``recording``: one forward's senders and residual stream (``Recording``);
- ``plan``: what each receiver reads (``Plan``) and the sums of one reading point (``Mix``,
  embedding bags over the senders' table);
- ``gradients``: the receivers' gradients (``ReceiverGradients``, ``rms_input_gradient``);
- ``norms``: an RMS norm's weight and eps, read from the module;
- ``points``: tensors at the patched tokens;
- ``state``: what one installed patch's parts share during a pass (``PassState``);
- ``senders``: the hooks that record the senders and write their differences into the table;
- ``receivers``: the hooks at the reading points (layer inputs, the MLPs' pre-norms, the final
  norm) that give the receivers their inputs and keep the MLPs' and the logits' gradients;
- ``stand_ins``: the modules in place of o_proj and the MLP (``AtPatchedPoints``) and of
  q_proj, k_proj and v_proj (``ReceiverProjection``);
- ``install``: putting the hooks and stand-ins on a model and taking them off (``Installed``);
- ``patch``: ``EdgePatch``, what ``intervened`` installs.
"""

from attnlab.edges.gradients import ReceiverGradients, rms_input_gradient
from attnlab.edges.graph import Graph
from attnlab.edges.install import REQUIRED
from attnlab.edges.patch import EdgePatch
from attnlab.edges.plan import Mix, Plan
from attnlab.edges.recording import Recording

__all__ = ["REQUIRED", "EdgePatch", "Graph", "Mix", "Plan", "ReceiverGradients", "Recording", "rms_input_gradient"]
