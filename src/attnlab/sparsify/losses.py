"""Next-token CE and KL(dense || sparse) over the vocabulary in position blocks: the values and
gradients of the whole-batch autograd version, bit for bit, without its intermediates."""

from __future__ import annotations

import torch
from torch.nn import functional as F


# Rows of the vocabulary-wide losses computed at a time: about 4 MB of float32 per chunk on a
# CPU, where it stays in cache. Whole [batch, sequence, vocabulary] tensors (200 MB each for
# SmolLM2's 49k vocabulary at 8 x 128) were sliced, copied and streamed through memory a dozen
# times per step: a fifth of a CPU training step. A GPU takes far larger chunks.
_CHUNK_ELEMENTS = {"cpu": 2 ** 20, "cuda": 2 ** 28}


def _chunks(shape: torch.Size, device: torch.device):
    """(sequence, first, last position) blocks over the positions that predict a next token,
    of even sizes and never a single row where a sequence has more: a one-row reduction is
    split across threads and sums in another order than the whole batch's (other last bits)."""
    batch, length, vocab = shape
    positions = length - 1
    rows = max(2, _CHUNK_ELEMENTS.get(device.type, 2 ** 24) // vocab)
    count = max(1, positions // rows)
    bounds = [i * positions // count for i in range(count + 1)]
    for sequence in range(batch):
        for first, last in zip(bounds, bounds[1:]):
            yield sequence, first, last


class _NextTokenLosses(torch.autograd.Function):
    """Next-token CE and KL(reference || model), means over tokens, in position chunks.

    The same floating-point operations per row as F.cross_entropy and
    ``(p * (log p - log q)).sum(-1).mean()`` on the shifted logits under autograd (values and
    gradients bit-identical, tests/test_sparse.py), without a shifted copy or any
    vocabulary-wide intermediate of the whole batch. The backward pass recomputes log q per
    chunk rather than keeping it.
    """

    @staticmethod
    def forward(ctx, logits, reference, ids):
        ctx.set_materialize_grads(False)
        picked = logits.new_empty(ids.shape[0], ids.shape[1] - 1, dtype=torch.float32)  # log q(next token)
        kl_rows = None if reference is None else torch.empty_like(picked)
        for sequence, first, last in _chunks(logits.shape, logits.device):
            log_q = F.log_softmax(logits[sequence, first:last].float(), -1)
            targets = ids[sequence, first + 1:last + 1, None]
            picked[sequence, first:last] = log_q.gather(-1, targets).squeeze(-1)
            if reference is not None:
                log_p = F.log_softmax(reference[sequence, first:last].float(), -1)
                kl_rows[sequence, first:last] = (log_p.exp() * (log_p - log_q)).sum(-1)
        ctx.save_for_backward(logits, reference, ids)
        # nll_loss sums the tokens in cross_entropy's order: the same CE to the last bit
        ce = F.nll_loss(picked.reshape(-1, 1), ids.new_zeros(picked.numel()))
        return ce, (picked.new_zeros(()) if kl_rows is None else kl_rows.mean())

    @staticmethod
    def backward(ctx, grad_ce, grad_kl):
        logits, reference, ids = ctx.saved_tensors
        tokens = ids.shape[0] * (ids.shape[1] - 1)
        grad = torch.empty_like(logits)
        grad[:, -1] = 0  # the last position predicts nothing
        for sequence, first, last in _chunks(logits.shape, logits.device):
            log_q = F.log_softmax(logits[sequence, first:last].float(), -1)
            # d/d log q of each term, through log-softmax's own backward as autograd does it
            upstream = []
            if grad_kl is not None and reference is not None:
                p = F.log_softmax(reference[sequence, first:last].float(), -1).exp()
                upstream.append(-((grad_kl / tokens) * p))
            if grad_ce is not None:
                targets = ids[sequence, first + 1:last + 1, None]
                upstream.append(torch.zeros_like(log_q).scatter_(
                    -1, targets, -(grad_ce / tokens).expand(last - first, 1)))
            parts = [torch._log_softmax_backward_data(g, log_q, -1, torch.float32) for g in upstream]
            grad[sequence, first:last] = sum(parts[1:], parts[0]) if parts else 0
        return grad, None, None


def loss_terms(logits: torch.Tensor, ids: torch.Tensor, reference: torch.Tensor | None):
    """(CE of the next token, KL(reference || model) per token or None), both means over tokens."""
    ce, kl = _NextTokenLosses.apply(logits, None if reference is None else reference.detach(), ids)
    return ce, (None if reference is None else kl)
