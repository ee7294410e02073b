"""Language-model loss over the output head without materialising the ``[n, v]`` logits.

Dims (``q38/dims.py``): ``n`` flattened tokens, ``d`` model width, ``v`` vocab; ``b`` (suffix only) is a block of
vocab columns.

Both functions return ``sum_{valid t} CE(hidden_t @ w_headᵀ, target_t) / normalizer``. The normalizer is the number
of valid targets of the *whole step* (all micro-batches, DP and CP ranks; see
docs/objective.md#terms), supplied by the caller and never computed here, so chunking,
gradient accumulation and sharding do not change the value or the gradients.

Precision: the head matmul runs in ``promote(hidden.dtype, w_head.dtype)``; its result is upcast to at least fp32
(fp64 stays fp64, which lets ``gradcheck`` run) and softmax, logsumexp and the loss sum are computed in that dtype.
"""

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int, Shaped
from torch import Tensor

from q38.batch import IGNORE_INDEX
from q38.kernels import DEFAULT_KERNELS, KernelConfig

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
    ignore_index: int = IGNORE_INDEX,
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


def _block_cols(chunk: int, num_tokens: int, vocab: int) -> int:
    """Vocab columns per block so that ``[n, block]`` holds as many logits as ``[chunk, v]`` (at least 1)."""
    return max(1, min(vocab, chunk * vocab // max(num_tokens, 1)))


def _block_logits(x_nd: Tensor, w_bd: Tensor, out_nb: Tensor, low_nb: Tensor | None) -> Tensor:
    """``x @ w_blockᵀ`` in the matmul dtype, written to ``out_nb`` (matmul dtype = compute dtype) or ``low_nb``."""
    return torch.mm(x_nd, w_bd.T, out=out_nb if low_nb is None else low_nb)


def _buffers(n: int, cols: int, mm_dtype: torch.dtype, compute_dtype: torch.dtype, device: torch.device):
    """Flat scratch for ``[n, cols]`` logits in the compute dtype (and the matmul dtype when that is lower)."""
    buf = torch.empty(n * cols, dtype=compute_dtype, device=device)
    low = None if mm_dtype == compute_dtype else torch.empty(n * cols, dtype=mm_dtype, device=device)
    return buf, low


def _view(flat: Tensor | None, n: int, b: int) -> Tensor | None:
    """A contiguous ``[n, b]`` view of the first ``n * b`` elements (also for the narrower last block)."""
    return None if flat is None else flat[: n * b].view(n, b)


# ---- the fused block epilogues (kernels.loss: compiled) ----------------------------------------------------------
# Each is one elementwise / row-reduction pass over a block of logits in the matmul dtype, where the eager loop makes
# five (forward: max, shift, exp, sum) or four (backward: shift, exp, one-hot, cast) passes over fp32 copies. On an
# accelerator those passes are memory-bound and are what the chunked loss pays on top of its matmuls; fused, the
# block is read once in forward and read and written once in backward. Same math: the upcast to the compute dtype,
# exp(logit − shift) and the one-hot in the compute dtype, one rounding to the matmul dtype.


def _block_lse(logits_nb: Tensor, compute_dtype: torch.dtype) -> Tensor:
    """Per-row logsumexp of one block, in the compute dtype."""
    return torch.logsumexp(logits_nb.to(compute_dtype), dim=1)


def _block_grad_(logits_nb: Tensor, shift_n: Tensor, col_n: Tensor, onehot_n: Tensor) -> Tensor:
    """``exp(logit − shift) + onehot·[column = col]`` per row (``col`` −1: none), in ``shift``'s dtype, rounded once
    to the logits' dtype and written over them (in place: no second block-sized buffer)."""
    g = torch.exp(logits_nb.to(shift_n.dtype) - shift_n[:, None])
    cols = torch.arange(logits_nb.shape[1], device=logits_nb.device)
    g = g + torch.where(cols[None, :] == col_n[:, None], onehot_n[:, None], 0.0)
    return logits_nb.copy_(g)


_COMPILED: dict = {}


def _compiled(fn):
    """``torch.compile`` of one epilogue, made on first use (dynamic shapes: one compile serves every block width
    and token count)."""
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=True, fullgraph=True)
    return _COMPILED[fn]


class _ChunkedLMLossSum(torch.autograd.Function):
    """Sum over valid tokens of ``logsumexp(logits_t) - logits_t[target_t]``, one vocab block at a time.

    Both passes walk the vocab in blocks of ``b`` columns and compute ``[n, b]`` logits per block (``b`` chosen so
    that ``[n, b]`` holds as many logits as a ``[chunk, v]`` token chunk). Forward keeps an online logsumexp per
    token (``kernels.loss: compiled``: one fused logsumexp per block, combined by logaddexp); backward recomputes
    the same blocks with the same matmul shapes (so the logits match the forward ones bit for bit on a
    deterministic BLAS), writes each ``dw_head`` block once, directly in its final dtype, and
    accumulates ``dhidden`` ``[n, d]`` in the compute dtype. Splitting the vocab rather than the tokens keeps the
    accumulator at ``[n, d]`` instead of ``[v, d]`` (no fp32 copy of the head gradient for bf16 heads, no
    read-modify-write of ``[v, d]`` per chunk).

    Saved for backward: ``hidden``, ``w_head`` (the caller's tensors, no copies), ``targets`` and the logsumexp
    ``[n]``. Live memory in either pass: one ``[n, b]`` buffer in the compute dtype, plus one ``[n, b]`` in the
    matmul dtype when that is lower (bf16), plus ``[n, d]`` gradient accumulators.
    """

    @staticmethod
    def forward(ctx, hidden, w_head, targets, chunk, ignore_index, fused):
        n, v = hidden.shape[0], w_head.shape[0]
        mm_dtype, compute_dtype = _dtypes(hidden, w_head)
        x_nd, w_vd = hidden.to(mm_dtype), w_head.to(mm_dtype)
        valid_n = targets != ignore_index
        cols = _block_cols(chunk, n, v)
        ctx.chunk, ctx.ignore_index, ctx.fused = chunk, ignore_index, fused
        # fused: the block stays in the matmul dtype and one compiled pass gives its logsumexp
        buf, low = _buffers(n, cols, mm_dtype, mm_dtype if fused else compute_dtype, hidden.device)
        block_lse = _compiled(_block_lse) if fused else None
        max_n = torch.full((n,), -torch.inf, dtype=compute_dtype, device=hidden.device)
        lse_n = max_n.clone()  # fused: the running logsumexp
        sumexp_n = torch.zeros(n, dtype=compute_dtype, device=hidden.device)
        target_logit_n = torch.zeros(n, dtype=compute_dtype, device=hidden.device)
        for v0 in range(0, v, cols):
            v1 = min(v0 + cols, v)
            buf_nb, low_nb = _view(buf, n, v1 - v0), _view(low, n, v1 - v0)
            logits_nb = _block_logits(x_nd, w_vd[v0:v1], buf_nb, low_nb)
            in_block_n = valid_n & (targets >= v0) & (targets < v1)
            col_n = torch.where(in_block_n, targets - v0, 0)
            picked_n = logits_nb.gather(1, col_n[:, None]).squeeze(1).to(compute_dtype)
            target_logit_n += torch.where(in_block_n, picked_n, 0.0)
            if fused:  # blocks' logsumexps combined by logaddexp
                lse_n = torch.logaddexp(lse_n, block_lse(logits_nb, compute_dtype))
                continue
            # online logsumexp; the (upcast) shifted logits go to the compute-dtype buffer, in place when fp32
            new_max_n = torch.maximum(max_n, logits_nb.amax(dim=1).to(compute_dtype))
            shifted_nb = torch.sub(logits_nb, new_max_n[:, None], out=buf_nb)
            sumexp_n = sumexp_n * torch.exp(max_n - new_max_n) + shifted_nb.exp_().sum(dim=1)
            max_n = new_max_n
        if not fused:
            lse_n = max_n + torch.log(sumexp_n)
        loss = torch.where(valid_n, lse_n - target_logit_n, 0.0).sum()
        ctx.save_for_backward(hidden, w_head, targets, lse_n)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, w_head, targets, lse_n = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n, v = hidden.shape[0], w_head.shape[0]
        mm_dtype, compute_dtype = _dtypes(hidden, w_head)
        x_nd, w_vd = hidden.to(mm_dtype), w_head.to(mm_dtype)
        valid_n = targets != ctx.ignore_index
        cols = _block_cols(ctx.chunk, n, v)
        # dloss/dlogits = g * (softmax - onehot) on valid rows, 0 on ignored rows. |g| is folded into the exponent,
        # exp(logit - (lse - log|g|)), so the softmax takes no extra pass; sign(g) is applied to the [n, d] side.
        grad_loss = grad_loss.to(compute_dtype)
        abs_grad, sign = grad_loss.abs(), torch.sign(grad_loss)
        shift_n = torch.where(valid_n, lse_n - torch.log(abs_grad), torch.inf)
        onehot_scale_n = torch.where(valid_n, -abs_grad, 0.0)

        fused = ctx.fused
        buf, low = _buffers(n, cols, mm_dtype, compute_dtype if not fused else mm_dtype, hidden.device)
        block_grad_ = _compiled(_block_grad_) if fused else None
        dx_acc = torch.zeros(hidden.shape, dtype=compute_dtype, device=hidden.device) if need_dx else None
        dx_tmp = None
        if need_dx and mm_dtype != compute_dtype:
            dx_tmp = torch.empty(hidden.shape, dtype=mm_dtype, device=hidden.device)
        grad_w = torch.empty_like(w_head) if need_dw else None
        x_signed_nd = x_nd * sign.to(mm_dtype) if need_dw else None
        for v0 in range(0, v, cols):
            v1 = min(v0 + cols, v)
            w_bd = w_vd[v0:v1]
            buf_nb, low_nb = _view(buf, n, v1 - v0), _view(low, n, v1 - v0)
            logits_nb = _block_logits(x_nd, w_bd, buf_nb, low_nb)
            in_block_n = (targets >= v0) & (targets < v1)
            if fused:  # one pass: |g| * softmax, the one-hot, rounded once to the matmul dtype
                g_nb = block_grad_(logits_nb, shift_n, torch.where(in_block_n, targets - v0, -1), onehot_scale_n)
            else:
                g_nb = torch.sub(logits_nb, shift_n[:, None], out=buf_nb).exp_()  # |g| * softmax
                col_n = torch.where(in_block_n, targets - v0, 0)
                g_nb.scatter_add_(1, col_n[:, None], torch.where(in_block_n, onehot_scale_n, 0.0)[:, None])
                if low_nb is not None:  # the gradient matmuls run in the matmul dtype, like the reference's backward
                    g_nb = low_nb.copy_(g_nb)
            if need_dw:
                if grad_w.dtype == mm_dtype:
                    torch.mm(g_nb.T, x_signed_nd, out=grad_w[v0:v1])
                else:
                    grad_w[v0:v1] = torch.mm(g_nb.T, x_signed_nd)
            if need_dx:
                if dx_tmp is None:
                    dx_acc.addmm_(g_nb, w_bd)
                else:
                    dx_acc += torch.mm(g_nb, w_bd, out=dx_tmp)
        grad_hidden = dx_acc.mul_(sign).to(hidden.dtype) if need_dx else None
        return grad_hidden, grad_w, None, None, None, None


def chunked_lm_loss(
    hidden: Float[Tensor, "n d"],
    w_head: Float[Tensor, "v d"],
    targets: Int[Tensor, " n"],
    *,
    normalizer: float | int | Shaped[Tensor, ""],
    chunk_size: int | None = None,
    chunk_budget_bytes: int | None = None,
    ignore_index: int = IGNORE_INDEX,
    kernels: KernelConfig = DEFAULT_KERNELS,
) -> Float[Tensor, ""]:
    """Same value and gradients as :func:`unchunked_lm_loss`, never holding more than ``chunk_size * v`` logits.

    Design: **(b) recompute in backward** (as CCE), not (a) Liger's gradients-in-forward. Forward keeps only the
    per-token logsumexp ``[n]``; backward recomputes the logits block by block, turns them into
    ``grad * (softmax - onehot)`` in place and accumulates ``dhidden`` / writes ``dw_head``. Nothing of size
    ``[n, v]`` or ``[v, d]`` lives from forward to backward (the saved ``hidden`` / ``w_head`` are the caller's
    tensors), so it composes with activation checkpointing and with any later scaling of the loss (it is applied
    through ``grad_output``). The price is one extra head matmul: 4 instead of 3.

    Chunking: pass exactly one of ``chunk_size`` (tokens) or ``chunk_budget_bytes`` (tokens chosen by
    :func:`dynamic_chunk_size` for this call's ``n`` and ``v``). Either sets the size of the live logits block,
    ``chunk_size * v`` elements; the loop itself walks the vocab in ``[n, chunk_size * v // n]`` blocks (see
    ``_ChunkedLMLossSum`` for why: a ``[n, d]`` gradient accumulator instead of a ``[v, d]`` one, and forward and
    backward logits computed by identical matmuls). Ignored targets (``ignore_index``) contribute 0 loss and 0
    gradient, also when every target is ignored. Gradients come back in the dtypes of ``hidden`` and ``w_head``;
    ``dhidden`` is accumulated over vocab blocks in at least fp32, and each ``dw_head`` row is one matmul over all
    tokens, as in the reference.

    ``kernels.loss`` picks the block epilogues: ``torch`` (eager passes) or ``compiled`` (``torch.compile``'d).
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
    loss_sum = kernels.fn("loss")(hidden, w_head, targets.long(), chunk_size, ignore_index)
    return loss_sum / normalizer


def chunked_loss_sum_eager(hidden: Tensor, w_head: Tensor, targets: Tensor, chunk: int, ignore_index: int) -> Tensor:
    """``kernels.loss: torch``: ``_ChunkedLMLossSum`` with eager block epilogues."""
    return _ChunkedLMLossSum.apply(hidden, w_head, targets, chunk, ignore_index, False)


def chunked_loss_sum_compiled(
    hidden: Tensor, w_head: Tensor, targets: Tensor, chunk: int, ignore_index: int
) -> Tensor:
    """``kernels.loss: compiled``: ``_ChunkedLMLossSum`` with the ``torch.compile``'d block epilogues."""
    return _ChunkedLMLossSum.apply(hidden, w_head, targets, chunk, ignore_index, True)
