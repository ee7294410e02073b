"""Teacher-forced acceptance of the MTP heads as draft tokens (docs/evaluate.md#mtp-acceptance).

Depth ``d``'s draft at position ``t`` is the argmax of its logits (``mtp_hidden[d-1][t] @ headᵀ``), a guess of token
``t + 1 + d``; the main model's greedy token for that same target is the argmax of its logits at position ``t + d``.
The draft is *accepted* when the two are equal. It is counted where depth ``d``'s target is a valid target
(``mtp_targets[d-1][t] != -100``: the token exists in the same document and is a label).

``acceptance_counts`` returns sums (to be added over batches and ranks); ``acceptance_metrics`` turns them into rates:

* ``accept_<d>``: accepted / counted drafts of depth ``d``, and ``accept_<d>_<bucket>`` by the draft position's
  place in its document (``POSITION_BUCKETS``: 0-1k, 1k-4k, 4k and up);
* ``accept_len_<k>``: the expected accepted length with ``k`` drafts, ``1 + E[leading accepted drafts]``, the mean
  over the positions where all of depths ``1..k`` are counted of the number of leading accepted depths
  (``A_1 … A_j`` all accepted), plus the one token the verifying pass always yields. This is the number of tokens a
  speculative decoding step with ``k`` drafts would commit per main-model pass, if the drafted tokens were the
  sequence's own.

No ``[tokens, vocab]`` tensor is formed: the argmaxes run a block of rows at a time.
"""

import torch
from jaxtyping import Float, Int
from torch import Tensor

from q38.batch import IGNORE_INDEX
from q38.model import shift_tokens

ARGMAX_ROWS = 4096  # rows per logits block of the greedy tokens (a [rows, vocab] block at a time)
# (low, high, name): a draft at document position p falls in the bucket with low <= p < high
POSITION_BUCKETS = ((0, 1024, "0_1k"), (1024, 4096, "1k_4k"), (4096, None, "4k_up"))


def greedy_ids(hidden: Float[Tensor, "b s d"], w_head: Float[Tensor, "v d"]) -> Int[Tensor, "b s"]:
    """The argmax of ``hidden @ w_headᵀ`` at every position, a block of ``ARGMAX_ROWS`` rows at a time."""
    h = hidden.reshape(-1, hidden.shape[-1])
    out = torch.empty(h.shape[0], dtype=torch.long, device=hidden.device)
    for i in range(0, h.shape[0], ARGMAX_ROWS):
        out[i:i + ARGMAX_ROWS] = torch.nn.functional.linear(h[i:i + ARGMAX_ROWS], w_head).argmax(-1)
    return out.view(hidden.shape[:-1])


def n_counts(depths: int) -> int:
    """Length of ``acceptance_counts``' vector: per depth and bucket (counted, accepted), per k (positions, sum of
    leading accepted)."""
    return depths * len(POSITION_BUCKETS) * 2 + depths * 2


def acceptance_counts(
    hidden: Float[Tensor, "b s d"],
    mtp_hidden: tuple[Tensor, ...],
    w_head: Float[Tensor, "v d"],
    mtp_targets: tuple[Tensor, ...],
    info,
) -> Tensor:
    """This rank's acceptance sums (fp64, ``n_counts(D)`` entries, the layout ``acceptance_metrics`` reads) for the
    tokens of ``info`` (``q38.layers.context.SeqInfo``: document ids, positions; under context parallelism the main
    greedy tokens of the whole row are gathered, ``[b, s]`` ids, so that ``t + d`` may sit on the next rank)."""
    depths = len(mtp_hidden)
    main = greedy_ids(hidden, w_head)
    doc = info.doc_ids
    if not info.comm.is_local:
        main, doc = info.comm.all_gather_seq_async((main, doc), 1).wait()
    acc = []
    for d in range(1, depths + 1):
        target = shift_tokens(main, doc, d, fill=-1)  # the main greedy token at t + d (same document), -1 past it
        if not info.comm.is_local:
            target = torch.gather(target, 1, info.seq_idx)
        acc.append(greedy_ids(mtp_hidden[d - 1], w_head) == target)
    valid = [t != IGNORE_INDEX for t in mtp_targets]
    parts = []
    for d in range(depths):
        for low, high, _ in POSITION_BUCKETS:
            inb = (info.positions >= low) if high is None else (info.positions >= low) & (info.positions < high)
            counted = valid[d] & inb
            parts += [counted.sum(), (counted & acc[d]).sum()]
    all_valid = torch.ones_like(valid[0]) if depths else None
    run = torch.ones_like(acc[0]) if depths else None
    lead = torch.zeros_like(valid[0], dtype=torch.long) if depths else None
    for d in range(depths):
        all_valid = all_valid & valid[d]
        run = run & acc[d]
        lead = lead + run.long()
        parts += [all_valid.sum(), (lead * all_valid).sum()]
    if not parts:
        return torch.zeros(0, dtype=torch.float64)
    return torch.stack([p.double().cpu() for p in parts])


def acceptance_metrics(counts: list[float], depths: int, prefix: str = "eval_") -> dict[str, float]:
    """Rates from summed ``acceptance_counts``: ``accept_<d>``, ``accept_<d>_<bucket>`` (a bucket only when it counted
    a draft) and ``accept_len_<k>`` (``1 + mean leading accepted``; 1.0 when no position counted)."""
    out: dict[str, float] = {}
    nb = len(POSITION_BUCKETS)
    for d in range(depths):
        row = counts[d * nb * 2:(d + 1) * nb * 2]
        n, a = sum(row[0::2]), sum(row[1::2])
        out[f"{prefix}accept_{d + 1}"] = a / max(n, 1.0)
        for j, (_, _, name) in enumerate(POSITION_BUCKETS):
            if row[2 * j] > 0:
                out[f"{prefix}accept_{d + 1}_{name}"] = row[2 * j + 1] / row[2 * j]
    base = depths * nb * 2
    for k in range(depths):
        n, lead = counts[base + 2 * k], counts[base + 2 * k + 1]
        out[f"{prefix}accept_len_{k + 1}"] = 1.0 + lead / max(n, 1.0)
    return out
