"""Can a Triton GEMV read the decode step's weights faster than cuBLAS? (an experiment, not used by the engine)

y[M, N] = x[M, K] @ W[N, K]^T for the 31B's projections at M = 1 (decode) and M = 5 (verify, k = 4): cuBLAS
(torch.nn.functional.linear) against a streaming Triton kernel over a small grid of tile shapes, in TB/s of
weight bytes read.

  python bench/bench_gemv.py
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

SHAPES = {  # name: (N, K) of gemma-4-31B-it
    "qkv (sliding)": (16384, 5376),
    "o_proj": (5376, 8192),
    "gate_up": (43008, 5376),
    "down": (5376, 21504),
}


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr):
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    m = tl.arange(0, BM)
    k_len = K // SPLIT  # K is a multiple of SPLIT * BK for the shapes tried here
    k_lo = tl.program_id(1) * k_len
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(k_lo, k_lo + k_len, BK):
        k = k0 + tl.arange(0, BK)
        w = tl.load(w_ptr + n[:, None] * stride_wn + k[None, :], mask=(n < N)[:, None], other=0.0)
        x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=(m < M)[:, None], other=0.0)
        acc += tl.dot(x, tl.trans(w))
    out = y_ptr + m[:, None] * stride_ym + n[None, :]
    ok = (m < M)[:, None] & (n < N)[None, :]
    if SPLIT == 1:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=ok)
    else:
        tl.atomic_add(out, acc, mask=ok)


def gemv(x, w, bn, bk, split, warps, stages):
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty(M, N, dtype=x.dtype if split == 1 else torch.float32, device=x.device)
    if split > 1:
        y.zero_()
    _gemv_kernel[(triton.cdiv(N, bn), split)](x, w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0),
                                              BM=16, BN=bn, BK=bk, SPLIT=split, num_warps=warps, num_stages=stages)
    return y if split == 1 else y.to(x.dtype)


def main() -> None:
    dev = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, triton {triton.__version__}")
    print("| shape | M | cuBLAS µs | cuBLAS TB/s | best Triton µs | Triton TB/s | config (BN, BK, split, warps, stages) |")
    print("|---|---|---|---|---|---|---|")
    grid = list(itertools.product((16, 32, 64), (128, 256), (1, 2, 4), (4,), (4, 6)))
    for (name, (N, K)), M in itertools.product(SHAPES.items(), (1, 5)):
        w = torch.randn(N, K, dtype=torch.bfloat16, device=dev) * 0.02
        x = torch.randn(M, K, dtype=torch.bfloat16, device=dev)
        ref = torch.nn.functional.linear(x, w)
        t_cublas = do_bench(lambda: torch.nn.functional.linear(x, w), warmup=25, rep=200)
        best = (float("inf"), None)
        for cfg in grid:
            bn, bk, split, warps, stages = cfg
            if K % (split * bk):
                continue
            try:
                y = gemv(x, w, *cfg)
            except Exception:  # a tile that does not fit: skip it
                continue
            if not torch.allclose(y.float(), ref.float(), atol=2e-2, rtol=2e-2):
                print(f"  wrong result for {name} M={M} {cfg}")
                continue
            t = do_bench(lambda: gemv(x, w, *cfg), warmup=10, rep=100)
            best = min(best, (t, cfg))
        nbytes = N * K * 2
        t_best, cfg = best
        print(f"| {name} | {M} | {t_cublas * 1e3:.1f} | {nbytes / t_cublas / 1e9:.2f} | {t_best * 1e3:.1f} | "
              f"{nbytes / t_best / 1e9:.2f} | {cfg} |", flush=True)


if __name__ == "__main__":
    main()
