"""The CPU effects behind session 3's GDN speed-up, each measured side by side (one thread; CPU time, best of N,
except where said):

1. a batched matmul with a few denormal rows in one operand vs the same matmul on normal numbers;
2. ``exp`` over inputs in the normal range vs inputs holding -inf vs inputs whose result underflows;
3. the GDN causal conv + SiLU, forward+backward: session 2's ``F.conv1d`` over the transposed ``[b, ch, s]`` view vs
   q38's fused taps on ``[b, s, ch]``;
4. the torch GDN core forward+backward per call (mean wall time: page faults are spent in the kernel) and its minor
   page faults, with glibc's default allocator vs the setting ``q38 train`` makes on CPU (``tune_cpu_allocator``;
   each in its own subprocess, as it cannot be undone).

    python benchmarks/cpu_effects.py [--repeats 10]

Never asserted in tests.
"""

import argparse
import os
import resource
import subprocess
import sys
import time

import torch
import torch.nn.functional as F


def best(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        t = time.thread_time()
        fn()
        times.append(time.thread_time() - t)
    return min(times)


def gdn_core_variant(tuned: bool, repeats: int) -> None:
    """Child process: GDN core fwd+bwd per call (ms) and minor page faults per call, printed as two numbers."""
    from q38.layers.gdn import gated_delta_rule_chunked
    from q38.train.run.launch import tune_cpu_allocator

    if tuned and tune_cpu_allocator() is None:
        print("nan nan")
        return
    g = torch.Generator().manual_seed(0)
    b, s, h, a = 2, 1024, 8, 64
    q, k, v = (torch.randn(b, s, h, a, generator=g).requires_grad_() for _ in range(3))
    gate = (-torch.linspace(0.0, 2.7726, h).exp() * F.softplus(torch.randn(b, s, h, generator=g) + 1.0))
    gate.requires_grad_()
    beta = torch.rand(b, s, h, generator=g).requires_grad_()
    d_o = torch.randn(b, s, h, a, generator=g)

    def step():
        o, _ = gated_delta_rule_chunked(q, k, v, gate, beta)
        torch.autograd.grad(o, [q, k, v, gate, beta], d_o)

    step()
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(repeats):
        step()
    t = (time.perf_counter() - t0) / repeats  # wall time: the page faults are spent in the kernel
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0.ru_minflt) / repeats
    print(f"{t * 1e3:.2f} {faults:.0f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--variant", choices=("default", "tuned"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.variant:
        gdn_core_variant(args.variant == "tuned", args.repeats)
        return
    r = args.repeats
    rows = []
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(256, 64, 64, generator=g), torch.randn(256, 64, 128, generator=g)
    xd = x.clone()
    xd[:, 40:, :8] *= 1e-39  # a few denormal entries per matrix
    rows.append(("bmm [256,64,64]x[256,64,128]", "normal", best(lambda: x @ y, r), "some denormal rows",
                 best(lambda: xd @ y, r)))
    e = torch.rand(2, 8, 16, 64, 64, generator=g) * -80.0
    e_inf = e.clone()
    e_inf[..., ::2] = float("-inf")
    e_under = e - 100.0
    t_exp = best(lambda: e.exp(), r)
    rows.append(("exp over 1M elements", "inputs in [-80, 0]", t_exp, "half -inf", best(lambda: e_inf.exp(), r)))
    rows.append(("exp over 1M elements", "inputs in [-80, 0]", t_exp, "all underflowing",
                 best(lambda: e_under.exp(), r)))
    from q38.layers.gdn import causal_conv1d

    xc = torch.randn(2, 1024, 1024, generator=g).requires_grad_()
    w = torch.randn(1024, 4, generator=g).requires_grad_()

    def conv_ref():  # session 2's causal_conv1d (one document): left-pad, F.conv1d over the transposed view
        xp = torch.cat([xc.new_zeros(2, 3, 1024), xc], dim=1)
        out = F.silu(F.conv1d(xp.transpose(1, 2), w[:, None, :], groups=1024).transpose(1, 2))
        torch.autograd.grad(out.sum(), [xc, w])

    def conv_q38():
        torch.autograd.grad(F.silu(causal_conv1d(xc, w)).sum(), [xc, w])

    rows.append(("causal conv + SiLU fwd+bwd", "F.conv1d (session 2)", best(conv_ref, r), "q38 fused taps",
                 best(conv_q38, r)))
    core = {}
    for variant in ("default", "tuned"):
        out = subprocess.run([sys.executable, __file__, "--variant", variant, "--repeats", str(r)],
                             capture_output=True, text=True, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        core[variant] = [float(v) for v in out.stdout.split()[-2:]]
    rows.append(("GDN core fwd+bwd (2x1024x8x64)", f"glibc default ({core['default'][1]:.0f} faults)",
                 core["default"][0] / 1e3, f"tune_cpu_allocator ({core['tuned'][1]:.0f} faults)",
                 core["tuned"][0] / 1e3))
    print(f"{'what':<32}{'A':<28}{'A (ms)':>9}  {'B':<34}{'B (ms)':>9}{'B / A':>8}")
    for what, na, ta, nb, tb in rows:
        print(f"{what:<32}{na:<28}{ta * 1e3:>9.2f}  {nb:<34}{tb * 1e3:>9.2f}{tb / ta:>8.2f}")


if __name__ == "__main__":
    main()
