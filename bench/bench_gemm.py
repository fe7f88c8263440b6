"""cuBLAS at the row counts of batched verify steps: a model's layer projections, per step.

Rows above the GEMV's 16 go to cuBLAS (`F.linear`): a verify step of c sequences with k drafts has
c * (k + 1) rows (160 at c = 32, k = 4). For each --rows this times every distinct projection shape
of the model's layers as the server runs them (q/k/v and gate/up fused), sums them over the layers,
and prints ms per step next to its two floors: the weight bytes at the copy bandwidth and the FLOPs
at the matmul rate, both measured here. Dense layers only (MoE experts run other kernels).

Each shape runs over as many distinct weights as layers have it, back to back in one CUDA graph, as
a step runs them: a small model's projections would otherwise be timed from L2 and with the host's
launch gaps between them (E4B's came out ~30 us each, whatever their size).

    python bench/bench_gemm.py --model configs/gemma-4-31B-it --rows 32 64 128 160 192 256 320
    python bench/bench_gemm.py --blas cublas cublaslt   # torch's preferred_blas_library
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_offline import measure_bandwidth, measure_matmul_flops  # noqa: E402
from bench_step import replay_seconds  # noqa: E402

from gemma4serve.config import load_config  # noqa: E402


def projection_shapes(cfg) -> Counter:
    """(N, K) of every layer projection -> how many layers have it, fused as the server runs
    them: [q; k; v] (no v where K = V), o, [gate; up], down."""
    shapes = Counter()
    H = cfg.hidden_size
    for layer in cfg.layers:
        q = cfg.num_heads * layer.head_dim
        kv = layer.num_kv_heads * layer.head_dim
        if not layer.kv_shared:
            shapes[(q + kv * (1 if layer.k_eq_v else 2), H)] += 1
        else:
            shapes[(q, H)] += 1  # a KV-shared layer projects only its queries
        shapes[(H, q)] += 1
        shapes[(2 * layer.mlp_width, H)] += 1
        shapes[(H, layer.mlp_width)] += 1
    return shapes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="configs/gemma-4-31B-it")
    p.add_argument(
        "--rows", type=int, nargs="+", default=[32, 64, 96, 128, 160, 192, 240, 256, 320]
    )
    p.add_argument("--blas", nargs="+", default=["cublas"], choices=["cublas", "cublaslt"])
    args = p.parse_args()
    cfg = load_config(args.model)
    device, dtype = torch.device("cuda"), torch.bfloat16
    shapes = projection_shapes(cfg)
    weights = {
        shape: [torch.randn(shape, device=device, dtype=dtype) / 64 for _ in range(count)]
        for shape, count in shapes.items()
    }
    nbytes = sum(N * K * 2 * count for (N, K), count in shapes.items())
    bandwidth, rate = measure_bandwidth(device), measure_matmul_flops(device, dtype)
    print(f"{torch.cuda.get_device_name()}: copy {bandwidth / 1e9:,.0f} GB/s, "
          f"matmul {rate / 1e12:.0f} TFLOP/s; {args.model}: {len(cfg.layers)} layers, "
          f"{nbytes / 1e9:.1f} GB of projections")  # fmt: skip
    for blas in args.blas:
        torch.backends.cuda.preferred_blas_library(blas)
        print(f"\n{blas}: ms per step (floors: bytes at the bandwidth, FLOPs at the matmul rate)")
        for rows in args.rows:
            step, cells = 0.0, []
            for (N, K), layers in weights.items():
                x = torch.randn(rows, K, device=device, dtype=dtype)
                t = layers_replay_s(x, layers)
                step += t
                cells.append(f"{N}x{K} {t / len(layers) * 1e6:.1f} us")
            flops = rows * nbytes  # 2 FLOPs per weight and row, 2 bytes per weight
            print(f"  {rows:4d} rows: {step * 1e3:6.2f} ms ({nbytes / step / 1e12:4.2f} TB/s, "
                  f"{flops / step / 1e12:4.0f} TFLOP/s); floors {nbytes / bandwidth * 1e3:5.2f} / "
                  f"{flops / rate * 1e3:5.2f} ms | " + ", ".join(cells), flush=True)  # fmt: skip


def layers_replay_s(x: torch.Tensor, layers: list[torch.Tensor]) -> float:
    """Seconds of one replay of a CUDA graph that multiplies x by every weight of `layers` in turn
    (captured after an eager run, which picks cuBLAS's algorithm)."""

    def run():
        for weight in layers:
            F.linear(x, weight)

    return replay_seconds(run, iters=20)


if __name__ == "__main__":
    main()
