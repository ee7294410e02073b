"""The attention implementations that never build a dense ``[s, t]`` mask (``flex``, ``varlen``, ``npu``) against the
dense-mask references (``AttentionMask.dense``, ``sdpa``), on packed rows and context-parallel query slices.

The dense mask (``AttentionMask.dense``: causal on the un-split row's token indices AND same document) is the
reference every other form is checked against: FlexAttention's ``mask_mod`` and its compiled block mask, and the
``cu_seqlens`` segments of the varlen / NPU kernels. FlexAttention runs forward only on CPU and only compiled (its
first compile takes minutes on a 2-core machine): those cases are slow-marked; its backward is in tests/test_cuda.py.
"""

import pytest
import torch

import q38
import q38.kernels as K
from q38.errors import ConfigError, DataError
from q38.kernels import KernelConfig, resolve_kernels
from q38.layers.attention import AttentionMask, doc_segments, flex_mask_mod

S = 16
# four rows: a document over the 2-rank CP boundary (8), one document over every boundary, a boundary exactly at
# the CP split, and padding (-1) after two short documents
DOCS = torch.tensor([
    [0] * 5 + [1] * 7 + [2] * 4,
    [0] * 16,
    [0] * 8 + [1] * 8,
    [0] * 3 + [1] * 3 + [-1] * 10,
])


def _slice_mask(doc: torch.Tensor, ranks: int, rank: int) -> AttentionMask:
    """What ``attention_apply`` passes on CP rank ``rank`` of ``ranks`` (contiguous split): the local queries at
    their global indices against the all-gathered row."""
    b, s = doc.shape
    idx = torch.arange(s).expand(b, s)
    lo, hi = rank * s // ranks, (rank + 1) * s // ranks
    return AttentionMask(idx[:, lo:hi], doc[:, lo:hi], idx, doc)


def _dense_from_segments(seg, b: int, s: int, t: int) -> torch.Tensor:
    """The ``[b, s, t]`` mask a cu_seqlens kernel computes from ``seg``: segment ``i``'s flattened queries against
    its keys (taken from the concatenated key spans), causal aligned at the bottom right."""
    keys = [(r, j) for r, a, z in seg.k_spans for j in range(a, z)]  # concatenated key index -> (row, position)
    out = torch.zeros(b, s, t, dtype=torch.bool)
    for i in range(len(seg.cu_q) - 1):
        q0, q1, k0, k1 = seg.cu_q[i], seg.cu_q[i + 1], seg.cu_k[i], seg.cu_k[i + 1]
        assert q1 - q0 <= k1 - k0 <= seg.max_k and q1 - q0 <= seg.max_q
        for qi in range(q0, q1):
            row, pos = divmod(qi, s)
            for ki in range(k0, k1):
                k_row, k_pos = keys[ki]
                assert k_row == row  # a segment never mixes rows
                out[row, pos, k_pos] = (ki - k0) <= (qi - q0) + (k1 - k0) - (q1 - q0)
    return out


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_cu_seqlens_segments_equal_the_dense_mask_on_packed_rows_and_cp_slices(ranks):
    for rank in range(ranks):
        m = _slice_mask(DOCS, ranks, rank)
        b, s = m.q_idx.shape
        seg = doc_segments(m, b, s, S)
        assert torch.equal(_dense_from_segments(seg, b, s, S), m.dense()[:, 0]), (ranks, rank)
    # no mask (one causal document per row): one segment per row
    seg = doc_segments(None, 2, S, S)
    assert seg.cu_q == seg.cu_k == [0, S, 2 * S] and seg.max_q == seg.max_k == S


def test_cu_seqlens_refuse_a_document_that_comes_back_and_keys_that_are_not_the_row():
    doc = torch.tensor([[0] * 4 + [1] * 4 + [0] * 8])  # the dense mask joins the two runs of document 0
    with pytest.raises(DataError, match="document id 0 comes back after another document.*kernels.attention: flex"):
        doc_segments(_slice_mask(doc, 1, 0), 1, S, S)
    m = _slice_mask(DOCS, 2, 1)
    shuffled = AttentionMask(m.q_idx, m.q_doc, m.k_idx.flip(1), m.k_doc)
    with pytest.raises(ValueError, match="keys must be the whole row in order"):
        doc_segments(shuffled, 4, S // 2, S)


@pytest.mark.parametrize("ranks", [1, 2])
def test_flex_mask_mod_equals_the_dense_mask(ranks):
    """FlexAttention's ``mask_mod`` evaluated on every (query, key) pair (torch's ``create_mask``, a test-only
    densification) equals the dense mask, one device and every CP slice."""
    from torch.nn.attention.flex_attention import create_mask

    for rank in range(ranks):
        m = _slice_mask(DOCS, ranks, rank)
        b, s = m.q_idx.shape
        got = create_mask(flex_mask_mod(m), b, None, s, S, device="cpu")
        assert torch.equal(got, m.dense()), (ranks, rank)
    causal = create_mask(flex_mask_mod(None), None, None, S, S, device="cpu")
    assert torch.equal(causal[0, 0], torch.ones(S, S, dtype=torch.bool).tril())


def test_auto_picks_a_fused_attention_for_the_production_layout():
    """CUDA: flex for packed rows and CP (no dense mask), sdpa's flash kernel for one causal document per row without
    CP; NPU: npu where torch_npu is installed; CPU: sdpa (flex cannot train there). varlen only when named."""
    fused = {}
    for cp, packed in ((True, True), (True, False), (False, True), (False, False)):
        fused[cp, packed] = resolve_kernels(KernelConfig(), device="cuda", dtype="bfloat16", cp=cp,
                                            packed=packed).attention
    assert fused == {(True, True): "flex", (True, False): "flex", (False, True): "flex", (False, False): "sdpa"}
    assert resolve_kernels(KernelConfig(), device="cpu").attention == "sdpa"
    with pytest.raises(ConfigError, match="kernels.attention: flex has no backward on CPU"):
        resolve_kernels(KernelConfig(attention="flex"), device="cpu")
    assert resolve_kernels(KernelConfig(attention="flex"), device="cpu", train=False).attention == "flex"
    with pytest.raises(ConfigError, match="kernels.attention: varlen does not support context parallelism"):
        resolve_kernels(KernelConfig(attention="varlen"), device="cuda", dtype="bfloat16", cp=True)
    with pytest.raises(ConfigError, match="kernels.attention: varlen takes bfloat16/float16 on cuda, not float32"):
        resolve_kernels(KernelConfig(attention="varlen"), device="cuda", dtype="float32")
    rows = {(op, n): st for op, n, st in K.kernel_report(device="npu", dtype="bfloat16", cp=True)}
    assert rows[("attention", "npu")] in ("auto", K.REGISTRY["attention"]["npu"].problem())


def test_q38_kernels_shows_flex_for_packed_rows_and_cp_on_cuda(capsys):
    from q38.cli import main

    for extra in (["--cp"], []):
        assert main(["kernels", "--device", "cuda", "--dtype", "bf16", *extra]) == 0
        out = capsys.readouterr().out
        rows = dict(line.split(None, 1) for line in out.splitlines() if line.startswith("  attention."))
        assert rows["attention.flex"] == "auto" or K._compile_problem() is not None, out
        assert rows["attention.varlen"] == ("does not support context parallelism (a `cp` mesh dim > 1)" if extra
                                            else "usable when named (auto does not pick it)"), out


def test_flex_on_cpu_with_gradients_is_a_clear_error():
    from q38.layers.attention import flex_attention

    q = torch.randn(1, 2, 8, 16, requires_grad=True)
    with pytest.raises(NotImplementedError, match="flex has no backward on CPU.*kernels.attention: sdpa"):
        flex_attention(q, q.detach(), q.detach(), None, 0.25)


# ---- compiled FlexAttention on CPU (slow: the first compile takes minutes on a 2-core machine) -----------------

B, H, G, C, SL = 2, 4, 2, 16, 512  # 4 blocks of 128 per row (2 per CP slice): masked blocks exist


def _long_docs() -> torch.Tensor:
    doc = torch.zeros(B, SL, dtype=torch.long)
    doc[0, 100:] = 1
    doc[0, 300:] = 2  # document 1 spans the 2-rank CP boundary (256)
    doc[1, 256:] = 1  # a boundary exactly at the split
    doc[1, 450:] = -1
    return doc


@pytest.mark.slow
def test_flex_block_mask_and_forward_equal_the_dense_mask_and_sdpa():
    """The compiled block mask skips exactly the 128 × 128 blocks in which the dense mask hides every pair, and the
    compiled FlexAttention forward (fp32, GQA 4 query / 2 kv heads) equals SDPA under the dense mask within 1e-5, on
    packed rows and on the second of two CP query slices (queries at their global offset against every key)."""
    from q38.layers.attention import flex_attention, flex_block_mask, sdpa_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, n, SL, C, generator=g) for n in (H, G, G))
    doc = _long_docs()
    for rank, ranks in ((0, 1), (1, 2)):
        m = _slice_mask(doc, ranks, rank)
        s = m.q_idx.shape[1]
        bm = flex_block_mask(m, s, SL, "cpu")
        blocks = m.dense()[:, 0].unflatten(1, (-1, 128)).unflatten(3, (-1, 128)).any(4).any(2)  # [b, nq, nk]
        assert torch.equal(bm.to_dense()[:, 0].bool(), blocks) and not blocks.all(), (ranks, rank)
        qs = q[:, :, SL - s:]
        with torch.no_grad():
            got = flex_attention(qs, k, v, m, C**-0.5)
            want = sdpa_attention(qs, k, v, m, C**-0.5)
        assert (got - want).abs().max() <= 1e-5, (ranks, rank, (got - want).abs().max())


class _ReplayCP:
    """Two CP ranks in one process: the ``record`` pass gathers each rank's own tensor twice (right shapes, values
    unused); the replay pass returns the rank-order concatenation of what both ranks recorded (the layer's gather
    inputs depend only on its local input, so the replay is exactly what the all-gather returns)."""

    is_local = False

    def __init__(self, rank: int, records: list[list]):
        self.rank, self.records, self.calls = rank, records, 0

    def all_gather_seq_async(self, xs, dim):
        from q38.layers.context import Ready

        mine = self.records[self.rank]
        if len(mine) <= self.calls:  # recording
            mine.append(tuple(x.detach().clone() for x in xs))
            out = tuple(torch.cat([x, x], dim) for x in xs)
        else:
            out = tuple(torch.cat([self.records[0][self.calls][i], self.records[1][self.calls][i]], dim)
                        for i in range(len(xs)))
        self.calls += 1
        return Ready(out)


@pytest.mark.slow
def test_the_attention_layer_on_flex_builds_no_dense_mask_and_equals_sdpa(monkeypatch):
    """The attention layer with ``kernels.attention: flex`` on packed rows, on one device and as two CP ranks, with
    the dense-mask builder made to raise: it never builds one, and its output equals the layer on ``sdpa`` (dense
    mask, one device) within 1e-5 (fp32, forward)."""
    from q38.layers.attention import attention_apply
    from q38.layers.context import SeqInfo, seq_info
    from q38.layers.rope import positions_from_docs

    cfg = q38.ModelConfig.preset("tiny").replace(num_attention_heads=H, num_key_value_heads=G, head_dim=C,
                                                 initializer_range=0.1)
    p = q38.init_params(cfg, seed=0).layers[cfg.layer_types.index("full_attention")].mixer
    x = torch.randn(B, SL, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    doc = _long_docs()
    flex = K.DEFAULT_KERNELS.replace(attention="flex")
    with torch.no_grad():
        want = attention_apply(p, x, cfg, seq_info(doc, B, SL, "cpu"))

    def no_dense(self):
        raise AssertionError("a dense [s, t] attention mask was built on the flex path")

    monkeypatch.setattr(AttentionMask, "dense", no_dense)
    with torch.no_grad():
        one = attention_apply(p, x, cfg, seq_info(doc, B, SL, "cpu", kernels=flex))
    assert (one - want).abs().max() <= 1e-5, (one - want).abs().max()

    pos, idx, half = positions_from_docs(doc), torch.arange(SL).expand(B, SL), SL // 2
    records: list[list] = [[], []]

    def rank_info(r: int) -> SeqInfo:
        sl = slice(r * half, (r + 1) * half)
        return SeqInfo(doc[:, sl], pos[:, sl], idx[:, sl], True, _ReplayCP(r, records), kernels=flex)

    with torch.no_grad():
        for r in (0, 1):  # record each rank's gather inputs (outputs discarded)
            attention_apply(p, x[:, r * half:(r + 1) * half], cfg, rank_info(r))
        cp = torch.cat([attention_apply(p, x[:, r * half:(r + 1) * half], cfg, rank_info(r)) for r in (0, 1)], 1)
    assert (cp - want).abs().max() <= 1e-5, (cp - want).abs().max()
