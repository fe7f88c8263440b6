import sys
import torch
import torch.nn.functional as F
from gemma4serve_kernels import rms_norm, rmsnorm_residual_add
from gemma4serve_kernels.gemv import gemv

sys.path.insert(0, "bench")
sys.path.insert(0, "bench/experiments")
from bench_step import time_it  # noqa
from gluon_gemv import gemv_ring  # noqa

L, H, Q, I = 60, 5376, 8192, 21504
dev = torch.device("cuda")


def replay_ms(fn, iters=15):
    fn()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return time_it(g.replay, iters) * 1e3


torch.manual_seed(0)
print(torch.cuda.get_device_name())
shapes = {"qkv": (2 * Q, H), "o": (H, Q), "gate_up": (2 * I, H), "down": (H, I)}
w = {k: [torch.empty(n, kk, dtype=torch.bfloat16, device=dev).normal_(0, 0.02) for _ in range(L)]
     for k, (n, kk) in shapes.items()}
best = {"qkv": (64, 256, 5, 4), "gate_up": (64, 256, 5, 4), "o": (64, 256, 5, 4), "down": (64, 256, 5, 4)}
nw = torch.randn(H, dtype=torch.bfloat16, device=dev)
qw = torch.randn(Q, dtype=torch.bfloat16, device=dev)
x0 = torch.randn(1, H, dtype=torch.bfloat16, device=dev)
h0 = torch.randn(1, H, dtype=torch.bfloat16, device=dev)


def chain(use):
    def proj(name, a, glu=False):
        if name in use:
            return gemv_ring(a, w[name][i], *best[name], glu=glu)
        return gemv(a, w[name][i], glu=glu)
    x, h = x0, h0
    for i in range(L):
        x, n = rmsnorm_residual_add(x, h, nw, 1e-6, None, nw)
        a = proj("qkv", n)[:, :Q]
        for _ in range(3):
            a = rms_norm(a, qw, 1e-6)
        o = proj("o", a)
        x, n = rmsnorm_residual_add(x, o, nw, 1e-6, None, nw)
        g = proj("gate_up", n, glu=True)
        h = proj("down", g)
    return h


import os
print("EARLY_LAUNCH", os.environ.get("GEMMA4SERVE_EARLY_LAUNCH"))
for use in ((), ("gate_up",), ("qkv", "gate_up")):
    ts = [replay_ms(lambda: chain(use)) for _ in range(3)]
    print(f"step-like chain, ring for {use}: " + " ".join(f"{t:.3f}" for t in ts) + " ms")
