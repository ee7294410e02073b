"""CUDA kernel path vs the torch reference: FLA's chunk_gated_delta_rule against q38's chunked gated delta rule
(fp32 oracle), plain and packed (cu_seqlens), plus forward+backward time of both in bf16.

    python benchmarks/gdn_kernel.py          # needs CUDA and flash-linear-attention

Metric: relative RMSE ‖ref − fla‖₂ / ‖ref‖₂ (FLA's own test metric; its fp16 thresholds are 5e-3 for outputs).
"""

import time

import torch
import torch.nn.functional as F

from q38.layers.gdn import gated_delta_rule_chunked


def rel_rmse(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def inputs(b, s, h, a, p, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, s, h, a, device="cuda", generator=g)
    k = torch.randn(b, s, h, a, device="cuda", generator=g)
    v = torch.randn(b, s, h, p, device="cuda", generator=g)
    gate = -F.softplus(torch.randn(b, s, h, device="cuda", generator=g))
    beta = torch.rand(b, s, h, device="cuda", generator=g)
    return [t.to(dtype) if t is not gate else t for t in (q, k, v, gate, beta)]


def main():
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    backward_error = None
    print(f"{'case':<34}{'dtype':>10}{'rel RMSE o':>14}{'rel RMSE dq':>14}{'rel RMSE dv':>14}")
    for dtype in (torch.float32, torch.bfloat16):
        for packed in (False, True):
            q, k, v, g, beta = inputs(2, 1000, 8, 128, 128, dtype)
            doc = None
            for t in (q, k, v, g, beta):
                t.requires_grad_(True)
            if packed:  # 3 documents per row, fla takes them as one row + cu_seqlens
                doc = torch.zeros(2, 1000, dtype=torch.long, device="cuda")
                doc[:, 300:] = 1
                doc[:, 777:] = 2
            ref_in = [t.detach().float().requires_grad_(True) for t in (q, k, v, g, beta)]
            o_ref, _ = gated_delta_rule_chunked(*ref_in, doc_ids=doc)
            if packed:
                lens = torch.tensor([0, 300, 777, 1000, 1300, 1777, 2000], device="cuda", dtype=torch.int32)
                flat = [t.reshape(1, 2000, *t.shape[2:]) for t in (q, k, v, g, beta)]
                o, _ = chunk_gated_delta_rule(flat[0], flat[1], flat[2], g=flat[3].float(), beta=flat[4],
                                              use_qk_l2norm_in_kernel=True, cu_seqlens=lens)
                o = o.reshape(2, 1000, *o.shape[2:])
            else:
                o, _ = chunk_gated_delta_rule(q, k, v, g=g.float(), beta=beta, use_qk_l2norm_in_kernel=True)
            w = torch.randn_like(o_ref)
            (o_ref * w).sum().backward()
            try:
                (o.float() * w).sum().backward()
                dq, dv = f"{rel_rmse(q.grad, ref_in[0].grad):>14.2e}", f"{rel_rmse(v.grad, ref_in[2].grad):>14.2e}"
            except RuntimeError as e:  # FLA refuses its backward on some Triton versions (Hopper, FLA #640)
                dq = dv = f"{'refused':>14}"
                backward_error = str(e).splitlines()[0]
            print(f"{'packed 3 docs' if packed else 'plain':<34}{str(dtype).split('.')[-1]:>10}"
                  f"{rel_rmse(o, o_ref):>14.2e}{dq}{dv}")

    if backward_error:
        print(f"FLA backward not run: {backward_error}")

    def bench(fn, n=10):
        fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / n

    q, k, v, g, beta = inputs(4, 4096, 32, 128, 128, torch.bfloat16)
    for t in (q, k, v, beta):
        t.requires_grad_(True)

    backward = backward_error is None

    def run_fla():
        o, _ = chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
        if backward:
            o.sum().backward()

    def run_ref():
        o, _ = gated_delta_rule_chunked(q, k, v, g, beta)
        if backward:
            o.float().sum().backward()

    with torch.set_grad_enabled(backward):
        t_fla, t_ref = bench(run_fla), bench(run_ref, n=3)
    what = "fwd+bwd" if backward else "fwd only"
    print(f"\n{what}, b=4 s=4096 h=32 dk=dv=128 bf16 inputs: fla {t_fla*1e3:.2f} ms, torch reference "
          f"{t_ref*1e3:.2f} ms, ratio fla/reference {t_fla/t_ref:.3f}")


if __name__ == "__main__":
    main()
