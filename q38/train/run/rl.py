"""Post-training with rewards, the loop's pieces (docs/rl.md): reward functions (built in: ``numeric_answer``,
``answer_format``; a user's by ``module:function``), group-normalised advantages, packing completions into a
policy-gradient batch, the trainer's log-probs of that batch (for the train–rollout mismatch), and ``rl_iteration``:
rollout → rewards → advantages → one ``train_step`` with the policy-gradient terms.

A reward function is ``fn(prompt: str, completion: str, answer: str | None) -> float``; the texts come from the
caller's ``detokenize(ids) -> str``. A reward that raises or returns anything but a finite number stops the
iteration before it trains, with one line naming the prompt and the function (``RewardError``).
"""

import importlib
import math
import re
from typing import Callable, Iterator, Sequence

import attrs
import torch
from torch import Tensor

from q38.batch import IGNORE_INDEX
from q38.decode import DecodeHooks
from q38.errors import ConfigError, DataError
from q38.rollout import Completion, rollout
from q38.train.core.policy import PolicyLossConfig, policy_terms, token_logprobs
from q38.train.core.step import _as_step_batch, train_step


class RewardError(ValueError):
    """A reward function failed on a prompt or returned a value that is not a finite number."""


_NUMBER = r"-?\d+(?:\.\d+)?"
_ANSWER_LINE = re.compile(rf"(?:^|\n)Answer:[ \t]*({_NUMBER})[ \t]*$")


def numeric_answer(prompt: str, completion: str, answer: str | None) -> float:
    """1.0 when the last number in the completion equals the reference answer (as numbers, to 1e-6), else 0.0."""
    if answer is None:
        raise ValueError("this prompt has no reference answer; numeric_answer needs one (an `answer` per prompt)")
    found = re.findall(_NUMBER, completion)
    return float(bool(found) and math.isclose(float(found[-1]), float(answer), abs_tol=1e-6))


def answer_format(prompt: str, completion: str, answer: str | None) -> float:
    """1.0 when the completion ends with a line ``Answer: <number>``, else 0.0 (reference answer not needed)."""
    return float(_ANSWER_LINE.search(completion.rstrip("\n")) is not None)


BUILTIN = {"numeric_answer": numeric_answer, "answer_format": answer_format}


def load_reward(spec: str) -> Callable:
    """A built-in reward by name or a user's by ``module:function`` (imported)."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    mod, sep, name = spec.partition(":")
    if not sep or not mod or not name:
        raise ConfigError(f"reward {spec!r} is neither a built-in ({', '.join(BUILTIN)}) nor module:function")
    try:
        fn = getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"reward {spec!r} cannot be loaded ({type(e).__name__}: {e}); check the module is "
                          "importable and defines the function") from None
    if not callable(fn):
        raise ConfigError(f"reward {spec!r} is not a function")
    return fn


def score(rewards: Sequence[str], prompts: Sequence[str], answers: Sequence[str | None],
          completions: Sequence[Completion], texts: Sequence[str]) -> list[float]:
    """Each completion's reward: the sum of the reward functions' values (``rewards``: specs for ``load_reward``).
    ``prompts`` / ``answers`` by prompt index, ``texts`` by completion."""
    fns = [(spec, load_reward(spec)) for spec in rewards]
    out = []
    for c, text in zip(completions, texts):
        total = 0.0
        for spec, fn in fns:
            where = f"reward {spec} on prompt {c.prompt_index} ({prompts[c.prompt_index][:40]!r})"
            try:
                v = fn(prompts[c.prompt_index], text, answers[c.prompt_index])
            except Exception as e:  # noqa: BLE001 - a user's function: any failure is reported in one line
                msg = str(e).splitlines()[0] if str(e) else ""
                raise RewardError(f"{where} raised {type(e).__name__}: {msg}; the iteration was not trained on") \
                    from None
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise RewardError(f"{where} returned {v!r}, not a finite number; the iteration was not trained on")
            total += float(v)
        out.append(total)
    return out


def group_advantages(rewards: Sequence[float], group_size: int, *, scale: bool = True, eps: float = 1e-6
                     ) -> list[float]:
    """GRPO advantages: each reward minus its group's mean, divided by the group's standard deviation (Bessel's,
    as TRL) plus ``eps`` when ``scale`` (``scale=False``: Dr. GRPO's unscaled form). Groups are consecutive
    ``group_size`` rewards; a group of equal rewards gets advantage 0."""
    if not (isinstance(group_size, int) and group_size >= 2):
        raise ConfigError(f"rl.group_size must be an integer >= 2 (a group of one sample has no advantage), got "
                          f"{group_size!r}")
    if len(rewards) % group_size:
        raise ConfigError(f"{len(rewards)} rewards do not form groups of {group_size}")
    r = torch.tensor(list(rewards), dtype=torch.float64).view(-1, group_size)
    a = r - r.mean(1, keepdim=True)
    if scale:
        a = a / (r.std(1, keepdim=True) + eps)
    return a.reshape(-1).tolist()


def pack_rollouts(completions: Sequence[Completion], advantages: Sequence[float], row_len: int, *,
                  ref_logprobs: Sequence[Sequence[float]] | None = None, pad_id: int = 0) -> dict[str, Tensor]:
    """A policy-gradient batch: each completion with its prompt one document (first fit into rows of
    ``row_len``), prompts labelled -100, each completion token labelled with itself and carrying its recorded
    log-prob, its sequence's advantage and (optionally) the reference policy's log-prob. Completions without a
    token are left out. Completions that carry their routes (``rollout(record_routes=True)``) give ``routes``
    ``[rows, row_len, main layers, k]`` (-1 on padding): the training forward replays them."""
    seqs = [(c, a, None if ref_logprobs is None else ref_logprobs[i])
            for i, (c, a) in enumerate(zip(completions, advantages)) if c.tokens]
    if not seqs:
        raise ConfigError("no rollout produced a token; nothing to train on (check stop ids and max_new_tokens)")
    rows: list[list] = []
    used: list[int] = []
    for s in seqs:
        n = len(s[0].prompt) + len(s[0].tokens)
        if n > row_len:
            raise ConfigError(f"a prompt and its completion hold {n} tokens, more than the row length {row_len}; "
                              "raise the row length or lower max_new_tokens")
        for i, u in enumerate(used):
            if u + n <= row_len:
                rows[i].append(s)
                used[i] += n
                break
        else:
            rows.append([s])
            used.append(n)
    b = len(rows)
    ids = torch.full((b, row_len), pad_id, dtype=torch.long)
    labels = torch.full((b, row_len), IGNORE_INDEX, dtype=torch.long)
    docs = torch.full((b, row_len), -1, dtype=torch.long)
    old, adv, ref = (torch.zeros(b, row_len) for _ in range(3))
    with_routes = seqs[0][0].routes is not None
    if with_routes != all(c.routes is not None for c, _, _ in seqs):
        raise ConfigError("some completions carry their routes and some do not; record them for every rollout "
                          "(routing_replay) or none")
    if with_routes:
        routes = torch.full((b, row_len, *seqs[0][0].routes.shape[1:]), -1, dtype=torch.int16)
    doc = 0
    for r, members in enumerate(rows):
        at = 0
        for c, a, rl in members:
            p, n = len(c.prompt), len(c.prompt) + len(c.tokens)
            ids[r, at: at + n] = torch.tensor(c.prompt + c.tokens)
            labels[r, at + p: at + n] = torch.tensor(c.tokens)
            docs[r, at: at + n] = doc
            old[r, at + p: at + n] = torch.tensor(c.logprobs)
            adv[r, at: at + n] = a
            if rl is not None:
                ref[r, at + p: at + n] = torch.tensor(list(rl), dtype=torch.float32)
            if with_routes:
                routes[r, at: at + n] = c.routes
            at, doc = at + n, doc + 1
    batch = {"input_ids": ids, "labels": labels, "doc_ids": docs, "old_logprobs": old, "advantages": adv}
    if ref_logprobs is not None:
        batch["ref_logprobs"] = ref
    if with_routes:
        batch["routes"] = routes
    return batch


def _mesh_batch(batch: dict, mesh, mtp_depths: int, micro_batches: int = 1):
    """This rank's share of a packed policy-gradient batch (``shard_batch``), its rows first padded with empty ones
    (every label -100, document -1) to a multiple of the data-parallel ranks times ``micro_batches`` and its columns
    to a multiple of the CP size; on the mesh's device."""
    from q38.parallel.mesh import batch_row_rank, shard_batch

    _, n_rows = batch_row_rank(mesh)
    n_rows *= micro_batches
    b, s = batch["input_ids"].shape
    fill = {"labels": IGNORE_INDEX, "doc_ids": -1}
    rows, cols = -b % n_rows, -s % mesh.size("cp")  # rows over the data ranks, columns over CP
    if rows or cols:
        def grow(k, v):
            out = torch.full((b + rows, s + cols, *v.shape[2:]), fill.get(k, -1 if k == "routes" else 0), dtype=v.dtype)
            out[:b, :s] = v
            return out

        batch = {k: grow(k, v) for k, v in batch.items()}
    dt = mesh.device_mesh.device_type
    dev = torch.device(dt) if dt == "cpu" else torch.device(dt, getattr(torch, dt).current_device())
    return shard_batch({k: v.to(dev) for k, v in batch.items()}, mesh, mtp_depths)


def _forward_logprobs(params, mc, batch: dict, temperature: float, router_bias, lora: bool) -> Tensor:
    """The training forward's log-prob of every labelled token, HF-aligned like ``labels`` (0 where -100)."""
    from q38.lora import compute_form, merge_adapters
    from q38.model import LayerHooks, forward, head_weight

    sb = _as_step_batch(batch, mc.mtp_num_layers)
    hooks = LayerHooks(gather=compute_form) if lora else None  # the step's unmerged LoRA products
    out = forward(params, sb.input_ids, mc, doc_ids=sb.doc_ids, router_bias=router_bias, hooks=hooks,
                  routes=sb.routes)
    t = sb.targets.reshape(-1)
    valid = torch.nonzero(t != IGNORE_INDEX).flatten()
    h = out.hidden.reshape(-1, out.hidden.shape[-1]).index_select(0, valid)
    w = merge_adapters(compute_form(head_weight(params)))
    lp, _ = token_logprobs(h, w, t.index_select(0, valid), temperature=temperature)
    at_target = torch.zeros(t.numel(), dtype=torch.float32, device=t.device).index_copy(0, valid, lp)
    at_target = at_target.view_as(sb.targets)
    shifted = torch.zeros_like(at_target)  # target position t holds token t + 1: move it back
    shifted[:, 1:] = at_target[:, :-1]
    return torch.where(batch["labels"].to(t.device) != IGNORE_INDEX, shifted, torch.zeros_like(shifted))


@torch.no_grad()
def trainer_logprobs(state, batch: dict, temperature: float = 1.0) -> Tensor:
    """The training forward's log-prob of every labelled token of a packed batch, HF-aligned like ``labels``
    (``out[r, t]``: the log-prob of token ``t``; 0 where ``labels`` is -100). One process; a LoRA state runs its
    adapters unmerged, as the step does."""
    return _forward_logprobs(state.params, state.model_config, batch, temperature, state.router_bias,
                             state.peft is not None)


@torch.no_grad()
def reference_logprobs(state, batch: dict, temperature: float = 1.0, ref_params=None) -> Tensor:
    """The reference policy's log-probs of a packed batch (as ``trainer_logprobs``): ``ref_params`` (a frozen copy,
    plain tensors) when given, else a LoRA state's base with its adapters off (no second copy of the model)."""
    from q38.lora import base_params

    if ref_params is None:
        if state.peft is None:
            raise ConfigError("a KL term to a reference policy needs reference parameters for a full fine-tune "
                              "(ref_params=, a frozen copy) or a LoRA run (its base is the reference)")
        ref_params = base_params(state.params)
    return _forward_logprobs(ref_params, state.model_config, batch, temperature, state.router_bias, False)


def _check_ref_params(state, ref_params) -> None:
    """A frozen reference for a sharded state is sharded as the state is: the same leaves, shapes and placements."""
    from torch.distributed.tensor import DTensor

    from q38.lora import base_params
    from q38.pytree import named_leaves

    want, got = named_leaves(base_params(state.params)), named_leaves(ref_params)
    if [n for n, _ in want] != [n for n, _ in got]:
        raise ConfigError("ref_params do not have the state's parameter leaves; pass a frozen copy of the model "
                          "being trained (e.g. tree_map(lambda t: t.detach().clone(), state.params))")
    for (name, w), (_, g) in zip(want, got):
        same = isinstance(g, DTensor) == isinstance(w, DTensor) and tuple(g.shape) == tuple(w.shape) and (
            not isinstance(w, DTensor) or tuple(g.placements) == tuple(w.placements))
        if not same:
            raise ConfigError(f"ref_params leaf {name} is not placed as the sharded state's ({type(g).__name__} "
                              f"{tuple(g.shape)}); shard the reference as the state is (q38.parallel.shard("
                              "ref_params, mesh)) or copy the sharded parameters")


@torch.no_grad()
def mesh_reference_logprobs(state, batch: dict, mesh, temperature: float = 1.0, ref_params=None) -> Tensor:
    """``reference_logprobs`` of a state sharded on ``mesh`` (every rank calls it with the same packed ``batch``,
    as ``pack_rollouts`` gives it): a no-grad forward of the reference on the mesh, as the step runs its layers
    (FSDP gathers layer by layer in the compute form, experts reached by the EP dispatch, sequences split over CP),
    each rank on its own rows and sequence shard (``shard_batch``, micro-batch by micro-batch); the per-token
    log-probs are then gathered so every rank returns the whole batch's ``[rows, length]`` tensor, HF-aligned like
    ``labels`` (0 where -100), on ``batch``'s device. The reference: ``ref_params`` (a frozen copy sharded as the
    state is), else a LoRA state's base with its adapters off (no second copy)."""
    from q38.batch import split_micro_batches
    from q38.lora import base_params, compute_form
    from q38.model import LayerHooks, forward, head_weight
    from q38.train.core.policy import _chunk_rows
    from q38.train.core.step import step_runtime

    if ref_params is None:
        if state.peft is None:
            raise ConfigError("a KL term to a reference policy needs reference parameters for a full fine-tune "
                              "(ref_params=, a frozen copy sharded as the state is) or a LoRA run (its base is the "
                              "reference)")
        ref = base_params(state.params)
    else:
        _check_ref_params(state, ref_params)
        ref = ref_params
    mc, tc = state.model_config, state.train_config
    runtime = step_runtime(mesh, tc)
    runtime.bind(ref)
    hooks = LayerHooks(gather=lambda tree: compute_form(runtime.gather(tree)), dispatch=runtime.dispatch)
    b, s = batch["input_ids"].shape
    sb = _mesh_batch(batch, mesh, mc.mtp_num_layers, tc.micro_batches)
    mbs = split_micro_batches(sb, tc.micro_batches)

    def logprobs(hidden: Tensor, mb, w: Tensor) -> Tensor:  # [rows, cols] at target positions (0 elsewhere)
        t = mb.targets.reshape(-1)
        valid = torch.nonzero(t != IGNORE_INDEX).flatten()
        h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, valid)
        lp, _ = token_logprobs(h, w, t.index_select(0, valid), temperature=temperature,
                               chunk=_chunk_rows(h.shape[0], w.shape[0], tc))
        return torch.zeros(t.numel(), dtype=torch.float32, device=t.device).index_copy(0, valid, lp) \
            .view_as(mb.targets)

    if mesh.pp > 1:
        parts = _pipelined_logprobs(state, ref, mbs, mesh, runtime, hooks, logprobs)
    else:
        w = runtime.gather(head_weight(ref))
        parts = []
        for mb in mbs:
            info = attrs.evolve(runtime.seq_info(mb), kernels=state.kernels)
            out = forward(ref, mb.input_ids, mc, info=info, hooks=hooks, router_bias=state.router_bias,
                          routes=mb.routes)
            parts.append(logprobs(out.hidden, mb, w))
    # every rank's block into the whole (padded) batch: -inf elsewhere, a max over every rank (ranks that hold the
    # same block, e.g. EP peers of one row group, hold the same values; on pp, the stages without the head none)
    from q38.parallel.mesh import batch_row_rank

    r, n_rows = batch_row_rank(mesh)
    c = mesh.local_rank("cp")
    rows, cols = sb.targets.shape
    whole = torch.full((rows * n_rows, cols * mesh.size("cp")), float("-inf"), device=sb.targets.device)
    if parts:  # this rank's rows and sequence shard, at target positions
        whole[r * rows: (r + 1) * rows, c * cols: (c + 1) * cols] = torch.cat(parts)
    if mesh.pp > 1:  # over every rank (a stage's runtime reduces inside the stage only)
        import torch.distributed as dist

        dist.all_reduce(whole, op=dist.ReduceOp.MAX)
    else:
        whole = runtime.all_reduce_max(whole)
    at_target = whole[:b, :s].to(batch["labels"].device)
    shifted = torch.zeros_like(at_target)  # target position t holds token t + 1: move it back
    shifted[:, 1:] = at_target[:, :-1]
    return torch.where(batch["labels"] != IGNORE_INDEX, shifted, torch.zeros_like(shifted))


def _pipelined_logprobs(state, ref, mbs: list, mesh, runtime, hooks, logprobs: Callable) -> list[Tensor]:
    """The reference's no-grad forward over the pipeline (each stage its own chunks, the residual stream sent on in
    ``forward_order``); the last chunk's rank returns ``logprobs(hidden, mb, head weight)`` of every micro-batch,
    the other ranks an empty list."""
    from q38.model import forward_chunk, head_weight
    from q38.parallel.pipeline import PipeLink, forward_order, run_schedule

    mc = state.model_config
    chunks, pp, rank = mesh.chunks, mesh.pp, mesh.pp_rank
    ref = attrs.evolve(ref, mtp=None)  # the MTP depths' outputs are not needed (their inputs still travel)
    head = chunks[-1].rank == rank
    w = runtime.gather(head_weight(ref)) if head else None
    out: list = [None] * len(mbs)

    def fwd(c: int, i: int, inputs):
        mb = mbs[i]
        info = attrs.evolve(runtime.seq_info(mb), kernels=state.kernels)
        if chunks[c].embed:
            o = forward_chunk(ref, chunks[c].layers, mc, input_ids=mb.input_ids, mtp_input_ids=mb.mtp_inputs,
                              info=info, hooks=hooks, router_bias=state.router_bias)
        else:
            o = forward_chunk(ref, chunks[c].layers, mc, x=inputs[0], mtp_embeds=tuple(inputs[1:]), info=info,
                              hooks=hooks, router_bias=state.router_bias)
        if not chunks[c].head:
            return [o.x, *o.mtp_embeds]
        out[i] = logprobs(o.x, mb, w)
        return None

    def input_shapes(c: int, i: int) -> list:
        return [(*mbs[i].input_ids.shape, mc.hidden_size)] * (1 + mc.mtp_num_layers)

    link = PipeLink(mesh.group("pp"), pp, rank, runtime.device, pass_id=2)
    run_schedule(forward_order(chunks, rank, len(mbs)), chunks, link, fwd, None, input_shapes)
    return out if head else []


def policy_params(state):
    """The parameters a rollout samples from: plain tensors (a LoRA state's adapters merged, fp32)."""
    from q38.lora import merged_params

    return merged_params(state.params) if state.peft is not None else state.params


def mesh_rollout(state, mesh, prompts: Sequence[Sequence[int]], *, group_size: int, max_new_tokens: int, sampling,
                 stop_ids: Sequence[int] = (), max_bytes: int | None = None, hold_gathered: bool = False,
                 record_routes: bool = False) -> list[Completion]:
    """``rollout`` of a state sharded on ``mesh`` (every rank calls it with the same arguments; returns every
    rank's completions, in the order one process gives). Each rank decodes its own share of the prompts (a
    contiguous block; every rank needs at least one) on its own shards: the embedding, head and final norm are
    gathered once for the rollout, each main layer's parameters gathered (FSDP) when its turn comes in each decode
    step and dropped after it (``hold_gathered``: every layer gathered once and held for the rollout instead:
    memory of the whole gathered model, one gather per layer per rollout), experts left where EP put them and
    reached by the step's EP dispatch. Parameters run in the trainer's compute form (``param_dtype``); a LoRA
    state's adapters are merged layer by layer after the gather. The draws follow ``q38.decode.sample_at``, so the
    samples are those of one process. ``max_bytes`` prices this rank's share of the decode batch.

    On a pipelined layout (``pp`` > 1) the shares go to the data-parallel ranks of a stage, and the stages of one
    pipeline group decode the same share together: each runs only its own chunks' layers (their decode caches only),
    in the prefill and in every step, the hidden states sent from stage to stage and the last stage's logits
    broadcast over the group (``q38.parallel.pipeline.DecodePipe``), so every stage samples the same tokens.
    Routing replay (``record_routes``) is not built there."""
    import torch.distributed as dist

    from q38.lora import compute_form, merge_adapters
    from q38.model import ModelParams
    from q38.train.core.step import step_runtime

    pp = mesh.pp
    if pp > 1 and record_routes:
        raise ConfigError("routing replay on a pipelined layout (pp > 1) is not built (the pipelined step takes no "
                          "routes); drop pp from the layout or train without routing_replay")
    world, rank = dist.get_world_size(), dist.get_rank()
    runtime = step_runtime(mesh, state.train_config)
    # the prompts split over the data-parallel ranks: every rank, or on a pipelined layout the ranks of one stage
    # (the stages of one pipeline group decode the same share together)
    shares, share = (world, rank) if pp <= 1 else (world // pp, dist.get_rank(runtime.group))
    n = len(prompts)
    if n < shares:
        raise ConfigError(f"a rollout on {shares} data-parallel ranks needs at least {shares} prompts per iteration "
                          f"(each decodes its own share), got {n}; raise prompts_per_iteration")
    lo, hi = share * n // shares, (share + 1) * n // shares
    runtime.bind(state.params)
    lora = state.peft is not None

    def gather(tree):
        return merge_adapters(compute_form(runtime.gather(tree))) if lora else runtime.gather(tree)

    def any_rows(flag: bool) -> bool:
        t = torch.tensor(float(flag), device=runtime.device)
        if pp > 1:  # over every rank (a stage's runtime reduces inside the stage only)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return bool(t > 0)
        return bool(runtime.all_reduce_max(t) > 0)

    p = state.params
    pipe = None
    if pp > 1:
        from q38.parallel.pipeline import DecodePipe

        pipe = DecodePipe(mesh.chunks, mesh.group("pp"), pp, mesh.pp_rank, runtime.device)
    mine_layers = range(len(p.layers)) if pipe is None else sorted(pipe.layers)
    layers = list(p.layers)
    if hold_gathered:
        for i in mine_layers:
            layers[i] = gather(p.layers[i])

    def opt(t):  # a stage holds the embedding / head side only where its chunks own them
        return None if t is None or not torch.utils._pytree.tree_leaves(t) else gather(t)

    params = ModelParams(embed=opt(p.embed), layers=layers, final_norm=opt(p.final_norm), lm_head=opt(p.lm_head),
                         mtp=None)
    hooks = DecodeHooks(gather=(lambda t: t) if hold_gathered else gather, dispatch=runtime.dispatch,
                        any_rows=any_rows, pipe=pipe)
    # every stage's caches in the compute form's dtype (what the embedding gathers to)
    dtype = None if pipe is None else state.train_config.torch_param_dtype
    mine = rollout(params, state.model_config, prompts[lo:hi], group_size=group_size, max_new_tokens=max_new_tokens,
                   sampling=sampling, stop_ids=stop_ids, router_bias=state.router_bias, max_bytes=max_bytes,
                   hooks=hooks, first_prompt=lo, total_prompts=n, record_routes=record_routes, dtype=dtype)
    parts: list = [None] * world
    dist.all_gather_object(parts, (lo, mine))
    by_share = dict(parts)  # the stages of one pipeline group hold the same share
    return [c for lo_ in sorted(by_share) for c in by_share[lo_]]


def rl_iteration(state, prompts: Sequence[Sequence[int]], *, prompt_texts: Sequence[str],
                 answers: Sequence[str | None], detokenize: Callable[[Sequence[int]], str], rewards: Sequence[str],
                 group_size: int, max_new_tokens: int, sampling, row_len: int, stop_ids: Sequence[int] = (),
                 loss: PolicyLossConfig | None = None, ref_params=None, max_rollout_bytes: int | None = None,
                 updates: int = 1, mesh=None, routing_replay: bool = False):
    """One iteration: rollout from ``state`` → rewards → group advantages → ``updates`` calls of
    ``train_step`` with the policy-gradient terms on that one batch (after the first, the ratio to the rollout's
    log-probs leaves 1 and the clip acts). Returns ``(new state, metrics dict)``: the last step's metrics plus
    ``reward_mean``,
    ``reward_std``, ``response_length``, ``mismatch_max`` (max |rollout − trainer log-prob| over the trained
    tokens, measured before the update). With ``loss.kl_coef`` > 0 the batch carries reference log-probs
    (``reference_logprobs``: ``ref_params``, or a LoRA state's base). ``max_rollout_bytes``: the rollout's decode
    batch is priced and refused up front past it (``q38.rollout.rollout_bytes``).

    ``mesh``: ``state`` is sharded on it (every rank calls this with the same arguments): the rollout is
    ``mesh_rollout`` (each rank decodes its share, every rank gets every completion), every rank scores and packs
    the same batch (rows padded to a multiple of the data-parallel ranks) and the step trains on its share; the
    same samples and, within float rounding, the same update as one process. A KL term's reference log-probs run
    on the mesh (``mesh_reference_logprobs``: a LoRA state's base, or ``ref_params`` sharded as the state is).

    ``routing_replay``: the rollout records every token's experts and each update's forward uses them instead of
    the router's top-k (gates from the router's current probabilities of those experts; docs/rl.md)."""
    loss = loss or PolicyLossConfig(temperature=sampling.temperature)
    if not (isinstance(updates, int) and updates >= 1):
        raise ConfigError(f"rl.updates (optimizer steps per rollout batch) must be an integer >= 1, got {updates!r}")
    if not math.isclose(loss.temperature, sampling.temperature):
        raise ConfigError(f"rl.temperature of the loss ({loss.temperature}) and of sampling "
                          f"({sampling.temperature}) differ; the ratio needs the policy the rollout sampled from")
    mc, tc = state.model_config, state.train_config
    kw = {"group_size": group_size, "max_new_tokens": max_new_tokens, "sampling": sampling, "stop_ids": stop_ids,
          "record_routes": bool(routing_replay)}
    if mesh is None:
        comps = rollout(policy_params(state), mc, prompts, router_bias=state.router_bias,
                        max_bytes=max_rollout_bytes, **kw)
    else:
        comps = mesh_rollout(state, mesh, prompts, max_bytes=max_rollout_bytes, **kw)
    rew = score(rewards, prompt_texts, answers, comps, [detokenize(c.tokens) for c in comps])
    adv = group_advantages(rew, group_size)
    batch = pack_rollouts(comps, adv, row_len)
    if mesh is None:
        dev = torch.utils._pytree.tree_leaves(state.params)[0].device
        batch = {k: v.to(dev) for k, v in batch.items()}
        if loss.kl_coef > 0:
            batch["ref_logprobs"] = reference_logprobs(state, batch, loss.temperature, ref_params)
    else:
        if loss.kl_coef > 0:  # before the split: every rank holds the whole batch's reference, as one process
            batch["ref_logprobs"] = mesh_reference_logprobs(state, batch, mesh, loss.temperature, ref_params)
        batch = _mesh_batch(batch, mesh, mc.mtp_num_layers, tc.micro_batches)
    terms = policy_terms(mc, tc, loss)
    new = state
    for u in range(updates):
        new, m = train_step(new, batch, mesh, terms=terms)
        if u == 0:  # the mismatch is the first update's (before it, the parameters the rollout sampled from)
            first = m.as_dict()
    r = torch.tensor(rew)
    d = m.as_dict()
    d.update(reward_mean=float(r.mean()), reward_std=float(r.std()), mismatch_max=first["mismatch_max"],
             mismatch_mean=first["logprob_diff"], response_length=sum(len(c.tokens) for c in comps) / len(comps))
    return new, d


# ---- prompts and the loop ----------------------------------------------------------------------------------------

MAX_PROMPTS_BYTES = 1 << 30


@attrs.frozen
class PromptRecord:
    """One line of a prompts file: the ``prompt`` text and its reference ``answer`` (None when the line has none).
    A chat line keeps its ``chat`` record (``messages``, and ``tools`` / ``chat_template_kwargs`` where given):
    ``encode_prompts`` renders it through the tokenizer's chat template with the assistant turn opened, and
    ``prompt`` becomes that rendered text (what the reward functions are given); before it, ``prompt`` is empty."""

    prompt: str
    answer: str | None = None
    chat: dict | None = attrs.field(default=None, hash=False)


def encode_prompts(records: Sequence[PromptRecord], tok, source: str) -> tuple[list[PromptRecord], list[list[int]]]:
    """Each record's token ids as ``q38 generate`` encodes a prompt: a text prompt as it is (no bos), a chat through
    the chat template (ChatML without one) with the assistant turn opened; chat records come back with their
    rendered text as ``prompt``. ``source``: the prompts file (named in errors, with the line)."""
    from q38.train.run.generate import prompt_ids

    out, ids = [], []
    for i, r in enumerate(records):
        where = f"{source}:{i + 1}"
        p = prompt_ids({**r.chat, "from": where} if r.chat is not None else {"text": r.prompt, "from": where}, tok)
        ids.append(p)
        out.append(attrs.evolve(r, prompt=tok.decode(p)) if r.chat is not None else r)
    return out, ids


def load_prompts(path, rewards: Sequence[str] = ()) -> list[PromptRecord]:
    """A JSON-lines prompts file, one ``{"prompt": str, "answer": str | number}`` object a line, or a chat
    ``{"messages": [...], "answer": ...}`` (checked as the trainer's chat loader checks one; rendered by
    ``encode_prompts``). ``answer`` is optional unless a reward in ``rewards`` needs it (``numeric_answer``). Bad
    lines are one ``DataError`` naming the file and line."""
    from q38.files import parse_json, read_bounded

    data = read_bounded(path, MAX_PROMPTS_BYTES, f"prompts file {path}", follow=True)
    out = []
    for n, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        rec = parse_json(line, f"prompts file {path} line {n}", DataError)
        chat = isinstance(rec, dict) and "messages" in rec
        if chat and "prompt" in rec:
            raise DataError(f"prompts file {path} line {n} has both `prompt` and `messages`; give one (a text prompt "
                            "or a chat whose assistant turn the model writes)")
        if chat:
            from q38.train.data.chat import validate_chat_record

            validate_chat_record(rec, f"prompts file {path} line {n}")
        elif not isinstance(rec, dict) or not isinstance(rec.get("prompt"), str) or not rec["prompt"]:
            raise DataError(f"prompts file {path} line {n}: each line must be an object with a non-empty string "
                            "`prompt` or a chat's `messages` (and an `answer` where a reward needs one)")
        ans = rec.get("answer")
        if ans is not None and (isinstance(ans, bool) or not isinstance(ans, (str, int, float))):
            raise DataError(f"prompts file {path} line {n}: `answer` must be a string or a number, got {ans!r}")
        if ans is None and "numeric_answer" in rewards:
            raise DataError(f"prompts file {path} line {n} has no `answer`, which the reward numeric_answer needs; "
                            "add one to every line or drop that reward")
        keep = ("messages", "tools", "chat_template_kwargs")
        out.append(PromptRecord("" if chat else rec["prompt"], None if ans is None else str(ans),
                                {k: rec[k] for k in keep if k in rec} if chat else None))
    if not out:
        raise DataError(f"prompts file {path} holds no prompt")
    return out


def progress_line(m: dict) -> str:
    """One iteration's progress line: reward mean / std, mean response length, mismatch (max, and the step's mean),
    KL, clip fraction, entropy, loss."""
    return (f"iter {m.get('iteration', 0)} | reward {m['reward_mean']:.4f} ± {m['reward_std']:.4f} | "
            f"len {m['response_length']:.1f} | mismatch max {m['mismatch_max']:.2e} mean {m['mismatch_mean']:.2e} | "
            f"kl {m['kl']:.2e} | "
            f"clip {m['clip_frac']:.3f} | entropy {m['entropy']:.3f} | loss {m['loss']:.4f}")


def rl_loop(state, records: Sequence[PromptRecord], *, encode: Callable[[str], Sequence[int]],
            detokenize: Callable[[Sequence[int]], str], rewards: Sequence[str], iterations: int,
            prompts_per_iteration: int, group_size: int, max_new_tokens: int, sampling, row_len: int,
            stop_ids: Sequence[int] = (), loss: PolicyLossConfig | None = None, ref_params=None,
            start_iteration: int = 0, max_rollout_bytes: int | None = None, updates: int = 1, mesh=None,
            routing_replay: bool = False) -> Iterator[tuple]:
    """``rl_iteration`` ``iterations`` times over ``records`` in order (wrapping around), yielding ``(state,
    metrics, next_iteration)`` after each. Iteration ``i`` takes prompts ``i·P … i·P + P − 1`` (mod the count) and
    samples with seed ``sampling.seed + i``: the prompt cursor and the sampling RNG follow from ``i`` alone, so a
    run stopped after iteration ``i`` and started again from its state with ``start_iteration=i + 1`` goes on as
    if it had not stopped."""
    if not (isinstance(prompts_per_iteration, int) and prompts_per_iteration >= 1):
        raise ConfigError(f"rl.prompts_per_iteration must be an integer >= 1, got {prompts_per_iteration!r}")
    for it in range(start_iteration, start_iteration + iterations):
        picked = [records[(it * prompts_per_iteration + j) % len(records)] for j in range(prompts_per_iteration)]
        state, metrics = rl_iteration(
            state, [list(encode(r.prompt)) for r in picked], prompt_texts=[r.prompt for r in picked],
            answers=[r.answer for r in picked], detokenize=detokenize, rewards=rewards, group_size=group_size,
            max_new_tokens=max_new_tokens, sampling=attrs.evolve(sampling, seed=int(sampling.seed) + it),
            row_len=row_len, stop_ids=stop_ids, loss=loss, ref_params=ref_params,
            max_rollout_bytes=max_rollout_bytes, updates=updates, mesh=mesh, routing_replay=routing_replay)
        metrics["iteration"] = it
        yield state, metrics, it + 1


def save_rl_checkpoint(root, state, next_iteration: int, *, keep_last: int = 0):
    """``state`` as ``root/step_<step>`` (``q38.train.io.checkpoint.save_checkpoint``) with the loop's position:
    ``next_iteration`` fixes the prompt cursor and the sampling seed of what follows (``rl_loop``)."""
    from q38.train.io.checkpoint import save_checkpoint

    meta = {"step": int(state.step), "model_config": state.model_config.to_dict(),
            "train_config": state.train_config.to_dict(),
            "param_dtype": str(state.train_config.torch_param_dtype).removeprefix("torch."),
            "rl": {"next_iteration": int(next_iteration)}}
    return save_checkpoint(root, state, meta, keep_last=keep_last)


def load_rl_checkpoint(path, template) -> tuple:
    """``(state, next_iteration)`` from a checkpoint ``save_rl_checkpoint`` wrote, into ``template``'s shapes and
    placements; pass ``start_iteration=next_iteration`` to ``rl_loop`` to go on exactly."""
    from q38.train.io.checkpoint import load_checkpoint

    state, meta = load_checkpoint(path, template)
    it = (meta.get("rl") or {}).get("next_iteration")
    if type(it) is not int or it < 0:
        raise ConfigError(f"{path} holds no RL loop position (meta.json rl.next_iteration); it was not written by "
                          "save_rl_checkpoint: start the loop with start_iteration= by hand")
    return state, it


def rl_from(source: str, prompts_file: str, out: str, *, rewards: Sequence[str], iterations: int,
            prompts_per_iteration: int = 8, group_size: int = 8, max_new_tokens: int = 128, temperature: float = 1.0,
            top_p: float = 1.0, seed: int = 0, loss: PolicyLossConfig | None = None, updates: int = 1,
            routing_replay: bool = False, save_every: int = 0, overrides: dict | None = None,
            log: Callable[[str], None] = print):
    """``q38 rl``: ``rl_loop`` from a q38 run / checkpoint or a Hugging Face directory (its tokenizer, its run
    config's train settings: ``--set train.lr=…``), on one process, or on every rank under torchrun on the source's
    layout (or ``--set layout=…``: the state sharded, rollouts by ``mesh_rollout``). Prompts: ``load_prompts``; a
    progress line per iteration (rank 0); checkpoints (``save_rl_checkpoint``, every rank) in ``out`` every
    ``save_every`` iterations and at the end. A second call with the same ``out`` resumes from its newest checkpoint,
    exactly. Returns the last checkpoint."""
    from pathlib import Path

    from q38.decode import Sampling
    from q38.train.data.tokenizer import load_tokenizer
    from q38.train.io.dirs import check_run_out_dir
    from q38.train.run.inference import load_state, open_source
    from q38.train.run.launch import WorldInfo, _init_process_group, check_run, pick_backend, pick_device
    from q38.train.run.trainer import _make_mesh, _source_precision

    world = WorldInfo.from_env()
    # ``out`` never is, holds or lies inside the source or the prompts file (device and inode compared): the RL
    # checkpoints would land among the source's own and be taken for them
    check_run_out_dir(out, [(role, Path(p)) for role, p in (("source", source), ("prompts file", prompts_file))
                            if Path(p).exists()])
    records = load_prompts(prompts_file, rewards)
    for spec in rewards:
        load_reward(spec)
    src = open_source(source, overrides, world_size=world.world_size)
    cfg = src.cfg if src.checkpoint is not None else _source_precision(src.cfg)
    tok = load_tokenizer(cfg.data.tokenizer)
    records, ids = encode_prompts(records, tok, str(prompts_file))
    row_len = max(len(p) for p in ids) + max_new_tokens
    if row_len > cfg.model.max_position_embeddings:
        raise ConfigError(f"the longest prompt ({row_len - max_new_tokens} tokens) plus --max-new-tokens "
                          f"{max_new_tokens} pass the model's max_position_embeddings "
                          f"({cfg.model.max_position_embeddings}); lower --max-new-tokens")
    device = pick_device(cfg.run.device, world.local_rank)
    plan = check_run(cfg, world.world_size, device)
    created = world.world_size > 1 and _init_process_group(device, pick_backend(device, cfg.run.backend), world,
                                                           cfg.run.timeout_s)
    try:
        mesh, _ = _make_mesh(plan, world, device, cfg.model)
        state = load_state(attrs.evolve(src, cfg=cfg), world, device, plan, mesh)
        from q38.train.run.rl_memory import check_rollout_memory

        # before any rollout; on a mesh each data-parallel rank decodes its share of the prompts (mesh_rollout: on a
        # pipelined layout the stages of a pipeline group share one, each holding its own layers' caches; priced
        # here as if one rank held them all)
        share = -(-prompts_per_iteration // (world.world_size // (mesh.pp if mesh is not None else 1)))
        check_rollout_memory(state, ids, share, group_size, max_new_tokens, device)
        return _rl_run(state, mesh, records, ids, tok, Path(out) / "checkpoints", rewards=rewards,
                       iterations=iterations, prompts_per_iteration=prompts_per_iteration, group_size=group_size,
                       max_new_tokens=max_new_tokens, sampling=Sampling(temperature=temperature, top_p=top_p,
                                                                        seed=seed),
                       row_len=row_len, loss=loss or PolicyLossConfig(temperature=temperature), updates=updates,
                       routing_replay=routing_replay, save_every=save_every,
                       log=log if world.rank == 0 else (lambda line: None))
    finally:
        if created:
            import torch.distributed as dist

            dist.destroy_process_group()


def _rl_run(state, mesh, records, ids, tok, root, *, rewards, iterations, prompts_per_iteration, group_size,
            max_new_tokens, sampling, row_len, loss, updates, routing_replay, save_every, log):
    """``rl_from``'s loop once the state is loaded: resume from ``root``'s newest checkpoint, iterate, save."""
    from q38.train.io.checkpoint import latest_checkpoint
    from q38.train.run.generate import answer_text, special_ids, stop_tokens

    start = 0
    last = latest_checkpoint(root) if root.is_dir() else None
    if last is not None:
        state, start = load_rl_checkpoint(last, state)
        log(f"q38 rl: resuming from {last} at iteration {start}")
    by_text = {r.prompt: p for r, p in zip(records, ids)}
    skip = special_ids(tok)
    done = start
    for state, m, nxt in rl_loop(state, records, encode=lambda t: by_text[t],
                                 detokenize=lambda o: answer_text(tok, o, skip=skip)[0], rewards=rewards,
                                 iterations=iterations, prompts_per_iteration=prompts_per_iteration,
                                 group_size=group_size, max_new_tokens=max_new_tokens, sampling=sampling,
                                 row_len=row_len, stop_ids=stop_tokens(tok), loss=loss, start_iteration=start,
                                 updates=updates, mesh=mesh, routing_replay=routing_replay):
        log(progress_line(m))
        done = nxt
        if save_every and (nxt - start) % save_every == 0 and nxt < start + iterations:
            last = save_rl_checkpoint(root, state, nxt)
    if done > start or last is None:
        last = save_rl_checkpoint(root, state, done)
    return last
