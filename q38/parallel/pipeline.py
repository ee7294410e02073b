"""The pipeline axis (``pp``, docs/parallel.md#the-pipeline-axis): the stage split, which parameters a pipeline rank
owns, the 1F1B / interleaved 1F1B schedules, and the point-to-point links that carry activations forward and their
gradients back.

A layout with ``pp`` in its mesh splits the decoder layers into ``pp × virtual_stages`` chunks in pipeline order;
chunk ``g`` runs on pipeline rank ``g % pp`` (Megatron's interleaved assignment; with one virtual stage, chunk ``s``
is stage ``s``). The first chunk also owns the embedding, the last the final norm, the LM head and the MTP block.
A rank materialises only the parameters of its chunks, placed on its stage's ranks (the mesh without ``pp``) by the
layout's other rules. The step (``q38.train.core.pipeline_step``) runs each chunk's forward and backward in the
order :func:`schedule` gives, through a :class:`PipeLink`.
"""

import math
from collections.abc import Callable

import attrs
import torch
import torch.distributed as dist
from torch import Tensor

from q38.model_config import ModelConfig
from q38.parallel.layout import PIPELINE_DIM, Layout, LayoutError, PipelineSpec

# ---- the stage split -----------------------------------------------------------------------------------------------


@attrs.frozen
class Chunk:
    """One stage chunk: global index ``index`` in pipeline order, layers ``first..last`` (inclusive), run by
    pipeline rank ``rank``; ``embed`` / ``head``: it owns the embedding / the final norm, LM head and MTP block."""

    index: int
    first: int
    last: int
    rank: int
    embed: bool
    head: bool

    @property
    def layers(self) -> range:
        return range(self.first, self.last + 1)


def layer_costs(cfg: ModelConfig, seq: int = 4096) -> tuple[list[float], float, float]:
    """``(per-layer, embedding, head)`` costs that balance an automatic split: each layer's forward FLOPs per row of
    ``seq`` tokens (``q38.flops``: its mixer, router, shared and routed experts); the embedding counted as one average
    layer and the LM head as one average layer plus its MTP depths (Megatron's ``account_for_embedding_in_pipeline_
    split`` / ``account_for_loss_in_pipeline_split``)."""
    from q38.flops import _layer_forward
    from q38.layers.cost import Workload
    from q38.layers.kinds import layer_kinds

    w = Workload(rows=1, seq=seq)
    kinds = layer_kinds(cfg)
    per = [sum(_layer_forward(cfg, k, w)[0].values()) for k in kinds[: cfg.num_hidden_layers]]
    mean = sum(per) / len(per)
    mtp = sum(sum(_layer_forward(cfg, k, w)[0].values()) for k in kinds[cfg.num_hidden_layers:])
    return per, mean, mean + mtp


def balanced_split(costs: list[float], n: int, first_extra: float = 0.0, last_extra: float = 0.0
                   ) -> list[tuple[int, int]]:
    """``n`` contiguous non-empty ranges of ``costs`` minimising the largest range's cost (the first range also
    carries ``first_extra``, the last ``last_extra``); exact (dynamic programming), ties go to the earlier split."""
    L = len(costs)
    if n > L:
        raise ValueError(f"{n} chunks of {L} layers")
    pre = [0.0]
    for c in costs:
        pre.append(pre[-1] + c)

    def cost(a: int, b: int, k: int) -> float:  # layers a..b-1 as chunk k
        return pre[b] - pre[a] + (first_extra if k == 0 else 0.0) + (last_extra if k == n - 1 else 0.0)

    inf = float("inf")
    best = [[inf] * (L + 1) for _ in range(n + 1)]  # best[k][b]: first b layers in k chunks
    cut = [[0] * (L + 1) for _ in range(n + 1)]
    best[0][0] = 0.0
    for k in range(1, n + 1):
        for b in range(k, L - (n - k) + 1):
            for a in range(k - 1, b):
                v = max(best[k - 1][a], cost(a, b, k - 1))
                if v < best[k][b]:
                    best[k][b], cut[k][b] = v, a
    out, b = [], L
    for k in range(n, 0, -1):
        a = cut[k][b]
        out.append((a, b - 1))
        b = a
    return out[::-1]


def stage_split(layout: Layout, cfg: ModelConfig) -> tuple[Chunk, ...]:
    """The chunks of ``layout``'s pipeline for ``cfg`` (empty without ``pp``), checked: every layer in exactly one
    chunk, in order, at least one layer a chunk. Raises ``LayoutError`` naming the problem and the fix."""
    pp = layout.pp
    if PIPELINE_DIM not in layout.mesh_dim_names:
        return ()
    spec = layout.pipeline or PipelineSpec()
    n, L = pp * spec.virtual_stages, cfg.num_hidden_layers
    where = f"layout {layout.name!r}"
    if n > L:
        raise LayoutError(f"{where}: pp={pp} × virtual_stages={spec.virtual_stages} = {n} stage chunks but the model "
                          f"has {L} layers; every chunk needs a layer: lower pp or virtual_stages")
    if spec.stages == "auto":
        per, emb, head = layer_costs(cfg)
        ranges = balanced_split(per, n, emb, head)
    else:
        ranges = list(spec.stages)
        seen: dict[int, int] = {}
        for k, (a, b) in enumerate(ranges):
            if a > b or a < 0 or b >= L:
                raise LayoutError(f"{where}: pipeline.stages[{k}] = [{a}, {b}] is not a range of layers 0..{L - 1} "
                                  "([first, last], inclusive); fix the range")
            for i in range(a, b + 1):
                if i in seen:
                    raise LayoutError(f"{where}: pipeline.stages repeats layer {i} (in ranges {seen[i]} and {k}); "
                                      "each layer belongs to exactly one stage chunk")
                seen[i] = k
        missing = [i for i in range(L) if i not in seen]
        if missing:
            raise LayoutError(f"{where}: pipeline.stages misses layer(s) {missing} of 0..{L - 1}; add them to a "
                              "range (or write stages: auto)")
        if any(ranges[k + 1][0] != ranges[k][1] + 1 for k in range(n - 1)):
            raise LayoutError(f"{where}: pipeline.stages {[list(r) for r in ranges]} are not consecutive; list the "
                              "ranges in pipeline order, each starting after the previous one ends")
    return tuple(Chunk(k, a, b, k % pp, k == 0, k == n - 1) for k, (a, b) in enumerate(ranges))


def owns(chunks: tuple[Chunk, ...], rank: int, path: str) -> bool:
    """Whether pipeline rank ``rank`` owns parameter ``path`` (``embed``, ``layers.<i>...``, ``final_norm``,
    ``lm_head``, ``mtp...``; a LoRA leaf goes with its weight)."""
    mine = [c for c in chunks if c.rank == rank]
    head = path.split(".", 1)[0]
    if head == "embed":
        return any(c.embed for c in mine)
    if head in ("final_norm", "lm_head", "mtp"):
        return any(c.head for c in mine)
    if head == "layers":
        i = int(path.split(".")[1])
        return any(c.first <= i <= c.last for c in mine)
    raise KeyError(f"no pipeline stage owns parameter {path!r}")


def check_model(layout: Layout, cfg: ModelConfig) -> tuple[Chunk, ...]:
    """What a pipelined run of ``cfg`` needs beyond the split (refused before any process starts)."""
    chunks = stage_split(layout, cfg)
    if chunks and cfg.tie_word_embeddings:
        raise LayoutError(f"layout {layout.name!r}: pp with tied embeddings (tie_word_embeddings: true) is not "
                          "supported (the first and last stage would share the embedding); untie them or drop pp")
    return chunks


def check_micro_batches(layout: Layout, micro_batches: int) -> None:
    """The schedule's need for micro-batches: at least ``pp`` (fewer leave stages idle for the whole step, and the
    interleaved schedule cannot run), a multiple of ``pp`` for interleaved 1F1B (its rounds go ``pp`` micro-batches
    at a time)."""
    pp = layout.pp
    if pp <= 1:
        return
    spec = layout.pipeline or PipelineSpec()
    if micro_batches < pp:
        raise LayoutError(f"layout {layout.name!r}: pp={pp} with {spec.schedule} needs at least {pp} micro-batches "
                          f"(train.micro_batches={micro_batches}); set train.micro_batches >= {pp}")
    if spec.schedule == "interleaved_1f1b" and micro_batches % pp:
        raise LayoutError(f"layout {layout.name!r}: interleaved_1f1b runs micro-batches in rounds of pp={pp}, but "
                          f"train.micro_batches={micro_batches}; set it to a multiple of {pp}")


def fullest_stage(cfg, layout, world: int):
    """``(stage layout, stage world, owns(path))`` of the pipeline rank holding the most parameter elements per
    rank: what ``q38 plan``'s placement table shows for a ``pp`` layout (its layout is named ``<name>/stage``)."""
    from q38.model import abstract_params
    sizes = layout.resolve_mesh(world)
    pp = sizes["pp"]
    chunks = check_model(layout, cfg)
    stage_sizes = {n: s for n, s in sizes.items() if n != "pp"}
    stage = layout.stage_layout().with_mesh(**stage_sizes)
    pl = stage.placements(abstract_params(cfg), stage_sizes)
    local = {p: math.prod(x.shape) / x.shard_factor for p, x in pl.items()}
    r = max(range(pp), key=lambda r: sum(n for p, n in local.items() if owns(chunks, r, p)))
    return stage, world // pp, lambda path: owns(chunks, r, path)


# ---- schedules -----------------------------------------------------------------------------------------------------


@attrs.frozen
class Action:
    kind: str  # "F" (forward) or "B" (backward)
    chunk: int  # global chunk index
    mb: int


def schedule(pp: int, v: int, m: int, rank: int) -> list[Action]:
    """Rank ``rank``'s order of chunk forwards and backwards over ``m`` micro-batches: 1F1B for ``v == 1``
    (``pp - rank - 1`` warm-up forwards, then one forward one backward, then the remaining backwards), Megatron's
    interleaved 1F1B for ``v > 1`` (``m`` a multiple of ``pp``; warm-up ``2 (pp - rank - 1) + (v - 1) pp`` chunk
    forwards). Rank ``rank`` runs chunks ``rank, rank + pp, ...``."""
    total = m * v

    def fwd(k: int) -> Action:
        j = (k // pp) % v
        return Action("F", j * pp + rank, (k // (pp * v)) * pp + k % pp)

    def bwd(k: int) -> Action:
        j = v - 1 - (k // pp) % v
        return Action("B", j * pp + rank, (k // (pp * v)) * pp + k % pp)

    if v == 1:
        warm = min(pp - rank - 1, m)
    else:
        warm = min(2 * (pp - rank - 1) + (v - 1) * pp, total)
    out = [fwd(k) for k in range(warm)]
    f, b = warm, 0
    while f < total:
        out.append(fwd(f))
        f += 1
        out.append(bwd(b))
        b += 1
    while b < total:
        out.append(bwd(b))
        b += 1
    return out


def bubble_fraction(pp: int, m: int, v: int = 1) -> float:
    """The idle share of a 1F1B step, ``(pp - 1) / (m + pp - 1)``; interleaving divides the bubble time by ``v``
    (``(pp - 1) / v / (m + (pp - 1) / v)``)."""
    b = (pp - 1) / v
    return b / (m + b)


# ---- point to point ------------------------------------------------------------------------------------------------

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class PipeLink:
    """Sends a chunk's outputs to the next chunk's rank and its input gradients to the previous one, over the
    ``pp`` group (the ranks with this rank's coordinates on every other mesh dim). Sends are async and waited at
    ``finish()``; receives block. Each message has a tag of its own (chunk, micro-batch, direction, pass), so the
    order two ranks post them in need not match. A forward message carries its dtype first (one int64), so a
    receiver allocates what the sender computed in."""

    def __init__(self, group, pp: int, rank: int, device, pass_id: int = 0):
        self.ranks = dist.get_process_group_ranks(group)
        self.pp, self.rank, self.device = pp, rank, device
        self.pass_id = pass_id
        self._sends: list = []
        self.sent_bytes = 0

    def _tag(self, chunk: int, mb: int, direction: int, slot: int) -> int:
        return (((self.pass_id * 4096 + mb) * 256 + chunk) * 2 + direction) * 16 + slot

    def _send(self, t: Tensor, to: int, tag: int) -> None:
        t = t.detach().contiguous()
        self._sends.append((dist.isend(t, self.ranks[to], tag=tag), t))
        self.sent_bytes += t.numel() * t.element_size()

    def send_forward(self, chunk: int, mb: int, tensors) -> None:
        to = (chunk + 1) % self.pp
        for i, t in enumerate(tensors):
            self._send(torch.tensor([_DTYPES.index(t.dtype)], device=self.device), to, self._tag(chunk, mb, 0, 2 * i))
            self._send(t, to, self._tag(chunk, mb, 0, 2 * i + 1))

    def recv_forward(self, chunk: int, mb: int, shapes) -> list[Tensor]:
        """The outputs of chunk ``chunk - 1`` for micro-batch ``mb`` (shapes known to the receiver)."""
        src = (chunk - 1) % self.pp
        out = []
        for i, shape in enumerate(shapes):
            code = torch.empty(1, dtype=torch.int64, device=self.device)
            dist.recv(code, self.ranks[src], tag=self._tag(chunk - 1, mb, 0, 2 * i))
            buf = torch.empty(shape, dtype=_DTYPES[int(code)], device=self.device)
            dist.recv(buf, self.ranks[src], tag=self._tag(chunk - 1, mb, 0, 2 * i + 1))
            out.append(buf)
        return out

    def send_backward(self, chunk: int, mb: int, grads) -> None:
        to = (chunk - 1) % self.pp
        for i, g in enumerate(grads):
            self._send(g, to, self._tag(chunk, mb, 1, i))

    def recv_backward(self, chunk: int, mb: int, likes) -> list[Tensor]:
        """The gradients of chunk ``chunk``'s outputs ``likes`` from chunk ``chunk + 1``."""
        src = (chunk + 1) % self.pp
        out = []
        for i, like in enumerate(likes):
            buf = torch.empty_like(like)
            dist.recv(buf, self.ranks[src], tag=self._tag(chunk + 1, mb, 1, i))
            out.append(buf)
        return out

    def finish(self) -> None:
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()


def run_schedule(actions: list[Action], chunks: tuple[Chunk, ...], link: PipeLink, forward, backward,
                 input_shapes) -> None:
    """Run ``actions`` (one rank's :func:`schedule`): ``forward(chunk, mb, inputs)`` returns the tensors to send on
    (None for the last chunk; ``inputs`` None for the first), ``backward(chunk, mb, grads)`` the gradients of its
    inputs (``grads`` None for the last chunk); ``input_shapes(chunk, mb)`` the shapes a chunk receives."""
    last = len(chunks) - 1
    outputs: dict = {}
    for a in actions:
        if a.kind == "F":
            inputs = None if a.chunk == 0 else link.recv_forward(a.chunk, a.mb, input_shapes(a.chunk, a.mb))
            out = forward(a.chunk, a.mb, inputs)
            if a.chunk != last:
                outputs[(a.chunk, a.mb)] = out
                link.send_forward(a.chunk, a.mb, out)
        else:
            grads = None
            if a.chunk != last:
                grads = link.recv_backward(a.chunk, a.mb, outputs.pop((a.chunk, a.mb)))
            gin = backward(a.chunk, a.mb, grads)
            if a.chunk != 0:
                link.send_backward(a.chunk, a.mb, gin)
    link.finish()


def forward_order(chunks: tuple[Chunk, ...], rank: int, m: int) -> list[Action]:
    """Forwards only (a no-grad pass): every micro-batch through this rank's chunks in pipeline order."""
    mine = [c.index for c in chunks if c.rank == rank]
    return [Action("F", g, mb) for mb in range(m) for g in mine]


def n_chunks_check(chunks: tuple[Chunk, ...], pp: int) -> int:
    """Chunks per pipeline rank (the same on every rank)."""
    v, r = divmod(len(chunks), pp)
    assert r == 0 and v >= 1, (len(chunks), pp)
    return v


def p2p_bytes_per_micro_batch(rows: int, seq: int, hidden: int, mtp_depths: int, act_bytes: int) -> int:
    """Bytes one chunk boundary carries per micro-batch in forward (the residual stream and the MTP depths' input
    embeddings, which travel from the first chunk to the last); backward carries the same back."""
    return math.prod((rows, seq, hidden)) * (1 + mtp_depths) * act_bytes


# ---- a pipelined decode (RL rollouts on a pp layout) ----------------------------------------------------------------


class DecodePipe:
    """One decode pass at a time over the pipeline (``q38.decode.DecodeHooks.pipe``): this rank runs the layers of
    its chunks in pipeline order, receiving each chunk's input from the previous chunk's rank and sending its output
    on (``PipeLink``, one message at a time: a decode step's chunks run one after another); the last chunk's rank
    computes the logits and broadcasts them over the ``pp`` group, so every stage of the group takes the same
    sampling steps. ``layers``: the main layers this rank runs (and holds decode caches for)."""

    def __init__(self, chunks: tuple[Chunk, ...], group, pp: int, rank: int, device):
        self.chunks, self.group, self.rank, self.device = chunks, group, rank, device
        self.ranks = dist.get_process_group_ranks(group)
        self.link = PipeLink(group, pp, rank, device)
        self.layers = frozenset(i for c in chunks if c.rank == rank for i in c.layers)

    def run(self, x: Tensor | None, shape: tuple, layer: Callable[[int, Tensor], Tensor]) -> Tensor | None:
        """``x = layer(i, x)`` over this rank's layers, chunk by chunk (``x``: the embedded tokens on the first
        chunk's rank; ``shape``: the hidden states' shape); the last chunk's output where this rank runs it, else
        None."""
        last = len(self.chunks) - 1
        for c in self.chunks:
            if c.rank != self.rank:
                continue
            if c.index > 0:
                x = self.link.recv_forward(c.index, 0, [shape])[0]
            for i in c.layers:
                x = layer(i, x)
            if c.index < last:
                self.link.send_forward(c.index, 0, [x])
                x = None
        self.link.finish()
        return x

    def head(self, x: Tensor | None, shape: tuple, fn: Callable[[Tensor], Tensor]) -> Tensor:
        """``fn(x)`` on the last chunk's rank (``x`` its output), broadcast over the ``pp`` group (``shape``: the
        result's shape; its dtype travels first)."""
        src = self.chunks[-1].rank
        code = torch.empty(1, dtype=torch.int64, device=self.device)
        if self.rank == src:
            out = fn(x).contiguous()
            code.fill_(_DTYPES.index(out.dtype))
        dist.broadcast(code, self.ranks[src], group=self.group)
        if self.rank != src:
            out = torch.empty(shape, dtype=_DTYPES[int(code)], device=self.device)
        dist.broadcast(out, self.ranks[src], group=self.group)
        return out
