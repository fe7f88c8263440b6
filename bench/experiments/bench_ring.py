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
from gemma4serve_kernels.activation import gelu_tanh_mul  # noqa
for M in (1, 5, 16):
    x = torch.randn(M, H, dtype=torch.bfloat16, device=dev)
    ref = gelu_tanh_mul(F.linear(x, w["gate_up"][0])).float()
    for cfg in [(64, 256, 5, 4), (128, 128, 4, 4)]:
        y = gemv_ring(x, w["gate_up"][0], *cfg, glu=True).float()
        err = ((y - ref).norm() / ref.norm()).item()
        assert err < 5e-3, (M, cfg, err)
        assert torch.equal(y, gemv_ring(x, w["gate_up"][0], *cfg, glu=True).float())
print("GLU ring correct")
x = torch.randn(1, H, dtype=torch.bfloat16, device=dev)
t_tr = replay_ms(lambda: [gemv(x, wi, glu=True) for wi in w["gate_up"]]) / L * 1e3
print(f"gate_up GLU alone: triton {t_tr:.1f} us")
for cfg in [(64, 256, 4, 4), (64, 256, 5, 4), (128, 128, 4, 4), (32, 256, 8, 4), (64, 128, 10, 4), (64, 256, 5, 8)]:
    t = replay_ms(lambda: [gemv_ring(x, wi, *cfg, glu=True) for wi in w["gate_up"]]) / L * 1e3
    print(f"gate_up GLU alone: ring {cfg} {t:.1f} us")
best = {"qkv": (64, 256, 5, 4), "gate_up": (64, 256, 5, 4)}
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


for cfg in [(64, 256, 4, 4), (64, 256, 5, 4), (128, 128, 4, 4), (32, 256, 8, 4)]:
    best["gate_up"] = cfg
    for use in ((), ("gate_up",), ("qkv", "gate_up")):
        print(f"step-like chain, ring for {use} gate_up {cfg}: {replay_ms(lambda: chain(use)):.3f} ms")
