"""Post-training with rewards, priced on a layout (docs/plan.md#post-training-with-rewards): the rollout's decode
batch (``G × prompts`` rows, each a decode cache at prompt + ``max_new_tokens``, and a decode step's logits) as its
own phase of the run, and the reference policy in every phase where it is held.

What each item counts, per rank (the fullest rank), as q38's one-process rollout allocates it
(``q38.rollout.rollout`` over ``q38.decode``), with the rows split like the training batch:

* rows: ``ceil(G · prompts / dp)``, ``dp`` the product of the layout's batch mesh dims; CP ranks of a data-parallel
  group hold the same rows (a decode step does not split a sequence);
* the decode cache of a row (``q38.decode.cache_bytes``): each GDN layer's conv window and fp32 recurrent state,
  each attention layer's keys and values in the compute dtype and a valid flag per position;
* prefill (one pass of the prompts, no gradient): the caches at the prompt length plus the widest layer's forward
  intermediates (what training saves for that layer; for a GDN layer its projections, conv and norms and the torch
  core's chunk factors, six ``[rows, heads, chunks, 64, 64]`` fp32 tensors alive at once, as measured) and the
  residual stream and hidden states of the prompt tokens;
* a decode step (the peak of the decode loop): the caches before and after the step (the step is functional: the
  old cache is freed when it returns), one attention layer's keys and values repeated to the query heads, and the
  logits with their fp32 sampling copies (the tempered logits, the probabilities, with top-p their sorted copy and
  int64 order);
* the policy's weights in compute form: the layer running and the one prefetched (gathered like the forward's,
  when the layout shards them), and with LoRA the merged fp32 copy ``policy_params`` makes (priced as every base
  shard in fp32, an upper bound);
* the reference policy: with LoRA the base with adapters off (nothing); a full fine-tune's frozen copy of the
  parameters in the compute dtype, sharded as the layout shards the parameters, held in every phase; or reference
  log-probs computed before the run (4 bytes a trained token, in the batch).
"""

import math

import attrs

from q38.model_config import ConfigError, ModelConfig
from q38.parallel.param_stats import Item

REFERENCES = ("copy", "logprobs", "none")  # a frozen copy, precomputed log-probs, no KL term (no reference)
SAMPLING_BYTES = 4 + 4 + 4 + 8  # per vocab entry: tempered fp32 logits, probabilities, top-p's sorted copy + order
PREFILL_GDN_CHUNK = 64  # prefill runs the torch GDN core (gdn_extend: gated_delta_rule_chunked's default chunk)
GDN_FACTORS = 6  # [rows, heads, chunks, C, C] fp32 tensors the torch core's chunk factors hold at once (measured)


@attrs.frozen(kw_only=True)
class RolloutPlan:
    """The rollout batch of one RL iteration: ``prompts`` prompts of up to ``prompt_len`` tokens (None: the row
    length less ``max_new_tokens``), ``group_size`` samples each, up to ``max_new_tokens`` new tokens. ``reference``:
    ``copy`` (a frozen copy of a full fine-tune's parameters), ``logprobs`` (reference log-probs in the batch, no
    copy), ``none`` (no KL term); None: ``copy`` for a full fine-tune, the adapters-off base for LoRA."""

    group_size: int
    prompts: int
    max_new_tokens: int
    prompt_len: int | None = None
    reference: str | None = None

    def __attrs_post_init__(self) -> None:
        for name in ("group_size", "prompts", "max_new_tokens", "prompt_len"):
            v = getattr(self, name)
            if v is None and name == "prompt_len":
                continue
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= (2 if name == "group_size" else 1)):
                raise ConfigError(f"rl {name} must be an integer >= {2 if name == 'group_size' else 1}"
                                  + (" (a group of one sample has no advantage)" if name == "group_size" else "")
                                  + f", got {v!r}")
        if self.reference is not None and self.reference not in REFERENCES:
            raise ConfigError(f"rl reference must be one of {', '.join(REFERENCES)}, got {self.reference!r}")

    @property
    def rows(self) -> int:
        return self.group_size * self.prompts


def _nbytes(dtype: str) -> int:
    return {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}[str(dtype)]


def row_cache_bytes(cfg: ModelConfig, length: int, act: int) -> int:
    """One row's decode cache after ``length`` tokens, cache dtype of ``act`` bytes (``q38.decode.cache_bytes``)."""
    import torch

    from q38.decode import cache_bytes

    return cache_bytes(cfg, 1, length, {4: torch.float32, 2: torch.bfloat16}[act])


def decode_items(cfg: ModelConfig, rows: int, prompt_len: int, max_new_tokens: int, act: int) -> list[Item]:
    """The decode batch of ``rows`` rows on one rank: prefill and decode-step items, each group transient (they
    are not alive together)."""
    from q38.parallel.budget_memory import layer_activations

    d, h, c = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    length = prompt_len + max_new_tokens - 1  # the last sampled token is never fed to the model
    at_prompt, at_end = rows * row_cache_bytes(cfg, prompt_len, act), rows * row_cache_bytes(cfg, length, act)

    def working(kind: str) -> float:  # one layer's no-grad forward over the prompts
        la = layer_activations(cfg, kind, float(rows), prompt_len, act_bytes=act, gdn_chunk=PREFILL_GDN_CHUNK)
        if kind != "linear_attention":
            return la.total
        chunks = -(-prompt_len // PREFILL_GDN_CHUNK)
        return la.rest + GDN_FACTORS * rows * cfg.linear_num_value_heads * chunks * PREFILL_GDN_CHUNK**2 * 4

    layer = max(working(kind) for kind in set(cfg.layer_types))
    attn = any(kind == "full_attention" for kind in cfg.layer_types)
    return [
        Item("rollout caches at the prompt", at_prompt, f"{rows} row(s) × {prompt_len} prompt tokens (GDN states, "
             "attention keys/values)", "prefill"),
        Item("prefill working set", layer + 2 * rows * prompt_len * d * act,
             "one layer's forward over the prompts (no gradient) + residual stream and hidden states", "prefill"),
        Item("rollout decode caches", at_end, f"{rows} row(s) × {length} tokens (prompt + max_new_tokens − 1, the "
             "last token is not fed): GDN conv windows and fp32 states, attention keys/values", "decode step"),
        Item("the step's new caches", at_end, "the functional step's output; the old cache is freed when it "
             "returns", "decode step"),
        Item("attention keys/values per head", 2 * rows * length * h * c * act if attn else 0,
             "one attention layer's keys and values repeated to the query heads", "decode step"),
        Item("decode logits and sampling", rows * cfg.vocab_size * (act + SAMPLING_BYTES),
             "logits, fp32 tempered copy and probabilities, top-p's sorted copy and int64 order", "decode step"),
    ]


def rollout_budget(cfg: ModelConfig, layout, mesh: dict, rl: RolloutPlan, st, ps, ls, start_items, *,
                   seq_len: int, tokens_per_rank: int) -> tuple[list[Item], list[Item], str]:
    """``(reference items, rollout phase items, a line saying the batch)`` for ``estimate``: the reference items
    are added to every phase (they stay alive the whole run); the rollout phase holds the state at rest
    (``start_items``' persistent ones), the reference, the policy's weights in compute form and the decode batch."""
    lora = ls is not None
    prompt_len = rl.prompt_len if rl.prompt_len is not None else seq_len - rl.max_new_tokens
    if prompt_len < 1:
        raise ConfigError(f"rl max_new_tokens {rl.max_new_tokens} leaves no prompt in a row of seq_len {seq_len}: "
                          "give --rl-prompt-len, or a longer --seq-len")
    if prompt_len + rl.max_new_tokens > cfg.max_position_embeddings:
        raise ConfigError(f"rl prompt length {prompt_len} + max_new_tokens {rl.max_new_tokens} passes the model's "
                          f"max_position_embeddings ({cfg.max_position_embeddings}); shorten either")
    reference = rl.reference or ("adapters" if lora else "copy")
    if lora and reference == "copy":
        raise ConfigError("rl reference copy with a LoRA run: the reference is the base with the adapters off (no "
                          "copy); drop --rl-reference or give logprobs / none")
    dp = math.prod(mesh.get(n, 1) for n in layout.batch_mesh_dims)
    rows = -(-rl.rows // dp)
    act = st.act
    ref: list[Item] = []
    if reference == "copy":
        ref.append(Item("reference policy (frozen copy)", ps.numel * act, f"{ps.numel:,} params in "
                        f"{st.param_dtype}, sharded as the parameters"))
    elif reference == "logprobs":
        ref.append(Item("reference log-probs", tokens_per_rank * 4, "fp32, one a token of the batch (precomputed)"))
    elif reference == "adapters":
        ref.append(Item("reference policy (base, adapters off)", 0, "LoRA: the frozen base is the reference"))
    phase = [it for it in start_items if not it.transient] + ref
    if lora:
        phase.append(Item("merged policy weights", ls.base.numel * 4, "policy_params: the adapters merged into an "
                          "fp32 copy of the base shards (upper bound: unadapted leaves are not copied)"))
    if ps.gathered_layers:  # prefill and every decode step run layer by layer, each gathered like the forward's
        phase.append(Item("rollout gathered layer", 2 * ps.largest_layer * act, "the layer running + the one "
                          "prefetched, compute form"))
    phase += decode_items(cfg, rows, prompt_len, rl.max_new_tokens, act)
    note = (f"{rl.prompts} prompts × G {rl.group_size} = {rl.rows} rows over dp {dp}: {rows} a rank, "
            f"{prompt_len} + {rl.max_new_tokens} tokens each")
    return ref, phase, note

