"""Language-model loss over the output head without materialising the ``[n, v]`` logits.

Dims (``q38/dims.py``): ``n`` flattened tokens, ``d`` model width, ``v`` vocab; ``c`` below is the token chunk.

Both functions return ``sum_{valid t} CE(hidden_t @ w_headᵀ, target_t) / normalizer``. The normalizer is the number
of valid targets of the *whole step* (all micro-batches, DP and CP ranks; see
``shared/reference/losses_and_kernels.md`` §1.8), supplied by the caller and never computed here, so chunking,
gradient accumulation and sharding do not change the value or the gradients.

Precision: the head matmul runs in ``promote(hidden.dtype, w_head.dtype)``; its result is upcast to at least fp32
(fp64 stays fp64, which lets ``gradcheck`` run) and softmax, logsumexp and the loss sum are computed in that dtype.
"""

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int, Shaped
from torch import Tensor

__all__ = ["chunked_lm_loss", "dynamic_chunk_size", "unchunked_lm_loss"]

# fp32 chunk logits plus as much again for the softmax / gradient temporaries.
_BYTES_PER_LOGIT = 4 * 2


def _dtypes(hidden: Tensor, w_head: Tensor) -> tuple[torch.dtype, torch.dtype]:
    """(matmul dtype, compute dtype): matmul in the promoted input dtype, everything else in at least fp32."""
    mm_dtype = torch.promote_types(hidden.dtype, w_head.dtype)
    return mm_dtype, torch.promote_types(mm_dtype, torch.float32)


def unchunked_lm_loss(
    hidden: Float[Tensor, "n d"],
    w_head: Float[Tensor, "v d"],
    targets: Int[Tensor, " n"],
    *,
    normalizer: float | int | Shaped[Tensor, ""],
    ignore_index: int = -100,
) -> Float[Tensor, ""]:
    """Reference loss: full ``[n, v]`` logits, upcast to fp32, ``cross_entropy(reduction="sum") / normalizer``."""
    mm_dtype, compute_dtype = _dtypes(hidden, w_head)
    logits_nv = (hidden.to(mm_dtype) @ w_head.to(mm_dtype).T).to(compute_dtype)
    loss = F.cross_entropy(logits_nv, targets.long(), reduction="sum", ignore_index=ignore_index)
    return loss / normalizer


def dynamic_chunk_size(num_tokens: int, vocab: int, budget_bytes: int) -> int:
    """Largest token count whose fp32 chunk logits, times 2 for temporaries, fit ``budget_bytes``.

    Clamped to ``[1, num_tokens]`` (1 when there are no tokens); a budget below one row still gives 1.
    """
    if vocab <= 0 or budget_bytes <= 0:
        raise ValueError(f"dynamic_chunk_size needs vocab > 0 and budget_bytes > 0, got {vocab=}, {budget_bytes=}")
    return max(1, min(num_tokens, budget_bytes // (vocab * _BYTES_PER_LOGIT)))


def _chunk_logits_(
    out_cv: Tensor, x_cd: Tensor, w_vd: Tensor, compute_dtype: torch.dtype
) -> Tensor:
    """Write ``x @ wᵀ`` upcast to ``compute_dtype`` into the preallocated ``out_cv`` and return it."""
    if x_cd.dtype == compute_dtype:
        return torch.mm(x_cd, w_vd.T, out=out_cv)
    return out_cv.copy_(torch.mm(x_cd, w_vd.T))  # low-precision matmul, then upcast (same as the reference)


class _ChunkedLMLossSum(torch.autograd.Function):
    """Sum of the per-token CE over chunks of tokens; logits are recomputed chunk by chunk in backward.

    Saved for backward: ``hidden``, ``w_head`` (references, no copies), ``targets`` and the per-token logsumexp
    ``[n]``. Live memory in either pass is one ``[c, v]`` buffer in the compute dtype (plus, when the matmul is in
    bf16, a ``[c, v]`` bf16 copy of the chunk gradient), the ``[n, d]`` input gradient and a ``[v, d]`` weight
    gradient accumulated in the compute dtype.
    """

    @staticmethod
    def forward(ctx, hidden, w_head, targets, chunk, ignore_index):
        n = hidden.shape[0]
        v = w_head.shape[0]
        mm_dtype, compute_dtype = _dtypes(hidden, w_head)
        w_vd = w_head.to(mm_dtype)
        valid_n = targets != ignore_index
        safe_targets_n = torch.where(valid_n, targets, 0)
        lse_n = torch.empty(n, dtype=compute_dtype, device=hidden.device)
        loss = torch.zeros((), dtype=compute_dtype, device=hidden.device)
        buf = torch.empty(min(chunk, n), v, dtype=compute_dtype, device=hidden.device)
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            logits_cv = _chunk_logits_(buf[: end - start], hidden[start:end].to(mm_dtype), w_vd, compute_dtype)
            target_logit_c = logits_cv.gather(1, safe_targets_n[start:end, None]).squeeze(1)
            # logsumexp in place: the buffer is scratch from here on
            max_c = logits_cv.amax(dim=1)
            lse_c = logits_cv.sub_(max_c[:, None]).exp_().sum(dim=1).log_().add_(max_c)
            lse_n[start:end] = lse_c
            loss += torch.where(valid_n[start:end], lse_c - target_logit_c, 0.0).sum()
        ctx.save_for_backward(hidden, w_head, targets, lse_n)
        ctx.chunk = chunk
        ctx.ignore_index = ignore_index
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, w_head, targets, lse_n = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        chunk = ctx.chunk
        n, d = hidden.shape
        v = w_head.shape[0]
        mm_dtype, compute_dtype = _dtypes(hidden, w_head)
        w_vd = w_head.to(mm_dtype)
        valid_n = targets != ctx.ignore_index
        safe_targets_n = torch.where(valid_n, targets, 0)
        # d loss / d logit_t = grad_loss * (softmax_t - onehot(target_t)) for valid t, 0 for ignored t
        scale_n = torch.where(valid_n, grad_loss.to(compute_dtype), 0.0)

        grad_hidden = torch.empty_like(hidden) if need_dx else None
        grad_w_acc = torch.zeros(v, d, dtype=compute_dtype, device=hidden.device) if need_dw else None
        dw_tmp = None
        if need_dw and mm_dtype != compute_dtype:
            dw_tmp = torch.empty(v, d, dtype=mm_dtype, device=hidden.device)
        buf = torch.empty(min(chunk, n), v, dtype=compute_dtype, device=hidden.device)
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            x_cd = hidden[start:end].to(mm_dtype)
            g_cv = _chunk_logits_(buf[: end - start], x_cd, w_vd, compute_dtype)
            scale_c = scale_n[start:end, None]
            g_cv.sub_(lse_n[start:end, None]).exp_().mul_(scale_c)
            g_cv.scatter_add_(1, safe_targets_n[start:end, None], -scale_c)
            g_mm = g_cv if mm_dtype == compute_dtype else g_cv.to(mm_dtype)
            if need_dx:
                if grad_hidden.dtype == mm_dtype:
                    torch.mm(g_mm, w_vd, out=grad_hidden[start:end])
                else:
                    grad_hidden[start:end] = torch.mm(g_mm, w_vd)
            if need_dw:
                if dw_tmp is None:
                    grad_w_acc.addmm_(g_mm.T, x_cd)
                else:  # low-precision matmul per chunk, summed over chunks in the compute dtype
                    grad_w_acc.add_(torch.mm(g_mm.T, x_cd, out=dw_tmp))
        grad_w = grad_w_acc.to(w_head.dtype) if need_dw else None
        return grad_hidden, grad_w, None, None, None


def chunked_lm_loss(
    hidden: Float[Tensor, "n d"],
    w_head: Float[Tensor, "v d"],
    targets: Int[Tensor, " n"],
    *,
    normalizer: float | int | Shaped[Tensor, ""],
    chunk_size: int | None = None,
    chunk_budget_bytes: int | None = None,
    ignore_index: int = -100,
) -> Float[Tensor, ""]:
    """Same value and gradients as :func:`unchunked_lm_loss`, never holding more than ``[chunk, v]`` logits.

    Design: **recompute in backward** (CCE-style, not Liger's gradients-in-forward). Forward runs the tokens in
    chunks and keeps only the per-token logsumexp ``[n]``; backward recomputes each chunk's logits, turns them into
    ``grad * (softmax - onehot)`` in place and accumulates ``dhidden`` and ``dw_head``. Nothing of size ``[n, v]``
    or ``[v, d]`` lives from forward to backward (the saved ``hidden`` / ``w_head`` are the caller's tensors), so it
    composes with activation checkpointing and with any later scaling of the loss. The price is one extra head
    matmul (4 instead of 3).

    Chunking: pass exactly one of ``chunk_size`` (tokens per chunk) or ``chunk_budget_bytes`` (chunk chosen by
    :func:`dynamic_chunk_size` for this call's ``n`` and ``v``). Ignored targets (``ignore_index``) contribute 0
    loss and 0 gradient, also when a whole chunk is ignored. Gradients come back in the dtypes of ``hidden`` and
    ``w_head``; the weight gradient is accumulated over chunks in at least fp32.
    """
    if (chunk_size is None) == (chunk_budget_bytes is None):
        raise ValueError(
            "chunked_lm_loss needs exactly one of chunk_size= or chunk_budget_bytes=, "
            f"got chunk_size={chunk_size}, chunk_budget_bytes={chunk_budget_bytes}"
        )
    if hidden.ndim != 2 or w_head.ndim != 2 or targets.shape != hidden.shape[:1] or w_head.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"expected hidden [n, d], w_head [v, d], targets [n]; got {tuple(hidden.shape)}, "
            f"{tuple(w_head.shape)}, {tuple(targets.shape)}"
        )
    if chunk_size is None:
        chunk_size = dynamic_chunk_size(hidden.shape[0], w_head.shape[0], chunk_budget_bytes)
    elif chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    loss_sum = _ChunkedLMLossSum.apply(hidden, w_head, targets.long(), chunk_size, ignore_index)
    return loss_sum / normalizer
