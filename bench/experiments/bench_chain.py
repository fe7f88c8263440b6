"""GEMV configs tuned in their place in the step, not alone: a 60-layer chain shaped like the batch-1 decode step
(norm -> qkv -> three small kernels -> o_proj -> norm -> gate_up + GELU.up -> down), PDL on, CUDA graph,
coordinate descent over each projection's config."""
import sys
import torch
from gemma4serve_kernels import rms_norm, rmsnorm_residual_add
from gemma4serve_kernels.gemv import gemv, gemv_config

sys.path.insert(0, "bench")
from bench_step import time_it  # noqa

L, H, Q, I = 60, 5376, 8192, 21504
SHAPES = {"qkv": (2 * Q, H), "o": (H, Q), "gate_up": (2 * I, H), "down": (H, I)}
CANDIDATES = {
    "gate_up": [(64, 256, 4, 3, 1), (128, 128, 4, 3, 1), (64, 256, 4, 4, 0), (64, 256, 4, 3, 0), (128, 128, 4, 3, 0),
                (32, 256, 2, 4, 0), (128, 256, 4, 2, 0), (64, 128, 4, 4, 0), (64, 128, 4, 5, 0)],
    "down": [(64, 256, 4, 4, 0), (64, 256, 4, 3, 0), (128, 128, 4, 3, 0), (32, 256, 2, 4, 1), (64, 128, 4, 4, 0)],
}


def replay_ms(fn, iters=15):
    fn()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return time_it(g.replay, iters) * 1e3


def main():
    torch.manual_seed(0)
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name())
    w = {k: [torch.empty(n, kk, dtype=torch.bfloat16, device=dev).normal_(0, 0.02) for _ in range(L)]
         for k, (n, kk) in SHAPES.items()}
    nw = torch.randn(H, dtype=torch.bfloat16, device=dev)
    qw = torch.randn(Q, dtype=torch.bfloat16, device=dev)
    x0 = torch.randn(1, H, dtype=torch.bfloat16, device=dev)
    h0 = torch.randn(1, H, dtype=torch.bfloat16, device=dev)
    default = {k: gemv_config(n // (2 if k == "gate_up" else 1), kk, dev, glu=k == "gate_up")
               for k, (n, kk) in SHAPES.items()}
    default["gate_up"] = gemv_config(*SHAPES["gate_up"], dev, glu=True)
    print("default", default)

    def chain(cfg, small=3):
        x, h = x0, h0
        for i in range(L):
            x, n = rmsnorm_residual_add(x, h, nw, 1e-6, None, nw)
            a = gemv(n, w["qkv"][i], cfg["qkv"])[:, :Q]
            for _ in range(small):
                a = rms_norm(a, qw, 1e-6)
            o = gemv(a, w["o"][i], cfg["o"])
            x, n = rmsnorm_residual_add(x, o, nw, 1e-6, None, nw)
            g = gemv(n, w["gate_up"][i], cfg["gate_up"], glu=True)
            h = gemv(g, w["down"][i], cfg["down"])
        return h

    gemv_only = sum(n * k * 2 for n, k in SHAPES.values()) * L
    best = dict(default)
    t_best = replay_ms(lambda: chain(best))
    print(f"default chain: {t_best:.3f} ms ({gemv_only / t_best / 1e9:.2f} TB/s of GEMV weights)")
    for rnd in range(2):
        for pos, cands in CANDIDATES.items():
            for c in cands:
                trial = {**best, pos: c}
                try:
                    t = replay_ms(lambda: chain(trial))
                except Exception as e:  # noqa
                    print(f"  {pos} {c}: failed {type(e).__name__}")
                    continue
                mark = ""
                if t < t_best - 0.005:
                    best, t_best, mark = trial, t, "  <- best"
                print(f"  round {rnd} {pos:8s} {c}: {t:.3f} ms{mark}")
        print(f"after round {rnd}: {t_best:.3f} ms {best}")
    t_def = replay_ms(lambda: chain(default))
    t_b = replay_ms(lambda: chain(best))
    print(f"final: default {t_def:.3f} ms, best {t_b:.3f} ms ({t_def - t_b:+.3f}); best {best}")
    for small in (0, 1):
        print(f"small kernels at the attention position = {small}: default {replay_ms(lambda: chain(default, small)):.3f}"
              f" best {replay_ms(lambda: chain(best, small)):.3f} ms")


if __name__ == "__main__":
    main()
