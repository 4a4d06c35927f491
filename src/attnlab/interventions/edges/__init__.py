"""The component graph of a decoder model, and the part of ``intervened`` that patches its edges.

Senders write into the residual stream: the token embeddings (with GPT-2's learned positions),
every attention head (its slice of the output projection, o_proj or c_proj: under grouped-query
attention still one per query head) and every MLP. Receivers read it:
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
  output gradient taken back through the layer's pre-norm (RMS or LayerNorm: one
  vector-Jacobian product for all heads; OLMo-2's query/key norm over every head first, one per
  head), an MLP's or the logits' the gradient that reaches its pre-norm's input.

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
query/key/value head's pre-norm (RMS, or a LayerNorm that centres first and adds its bias; read
from the module, ``anatomy.NormSpec``) is folded into its projection. The heads' differences are
W_O,h (z_h − corrupted z_h) from the output projection's inputs, and its output at the patched
tokens the corrupted run's plus their sum (without a post-norm of the attention block: with one,
each head's output is scaled by it and subtracted; a bias is no head's and cancels).

The parts come from the model's anatomy (``attnlab.anatomy``). Post-norms that rescale a block's
output before it joins the residual (Gemma-3's post_attention_layernorm and
post_feedforward_layernorm around pre-norms; OLMo-2's, which has no pre-norms) are RMS norms: a
head's contribution is its output-projection slice times the norm's scale of the block's whole
output, so the heads' contributions still add up to what the layer adds. Where no norm precedes
a sublayer (OLMo-2), its receivers read their own residual as it is: the MLP's through a
``ReadingPoint``. GPT-2's fused c_attn is one stand-in whose heads are its query, key and value
heads in turn. A query/key norm over every head at once (OLMo-2) is applied to each head's own
projection, so each head's query or key depends on its own input alone.

The modules, each below the ones that use it:

- ``graph``: the senders, receivers and edges (``Graph``), the edges table and masks;
- ``recording``: one forward's senders and residual stream (``Recording``);
- ``plan``: what each receiver reads (``Plan``) and the sums of one reading point (``Mix``,
  embedding bags over the senders' table);
- ``gradients``: the receivers' gradients (``ReceiverGradients``);
- ``points``: tensors at the patched tokens;
- ``state``: what one installed patch's parts share during a pass (``PassState``);
- ``senders``: the hooks that record the senders and write their differences into the table;
- ``receivers``: the hooks at the reading points (layer inputs, the MLPs' pre-norms, the final
  norm) that give the receivers their inputs and keep the MLPs' and the logits' gradients;
- ``stand_ins``: the modules in place of the output projection and the MLP (``AtPatchedPoints``),
  of q_proj, k_proj and v_proj or a fused qkv (``ReceiverProjection``), and before an MLP without
  a pre-norm (``ReadingPoint``);
- ``install``: putting the hooks and stand-ins on a model and taking them off (``Installed``);
- ``patch``: ``EdgePatch``, what ``intervened`` installs.
"""

from attnlab.interventions.edges.gradients import ReceiverGradients
from attnlab.interventions.edges.graph import Graph
from attnlab.interventions.edges.patch import EdgePatch
from attnlab.interventions.edges.plan import Mix, Plan
from attnlab.interventions.edges.recording import Recording

__all__ = ["EdgePatch", "Graph", "Mix", "Plan", "ReceiverGradients", "Recording"]
