"""Skinny GEMMs of a decode step: cuBLAS against kernels/gemv.py, in a CUDA graph like the engine.

The 31B's 60 layers of projections (sliding-layer shapes) as one dependent chain per step: qkv ->
o_proj -> gate_up + gelu·up (the GEMV's epilogue; cuBLAS then the activation kernel) -> down ->
next layer, weights 57.5 GB, captured once and replayed. Timing the chain, not single kernels,
counts what matters at batch 1: the ramp and drain between consecutive GEMMs, which programmatic
dependent launch (PDL) overlaps. First a tile sweep per shape, then the MLP pair as two GEMVs
against gemv_mlp (down awaiting gate_up's flags) with a sweep of down's split-K tiles, then the
chains.

  python bench/bench_gemv.py [--rows 1 5 8 16] [--skip-shapes]
  # One rank's shapes under tensor parallelism (column-parallel qkv and gate_up, row-parallel
  # o_proj and down), to tell the GEMVs' own efficiency at those shapes from the served step's.
  python bench/bench_gemv.py --tensor-parallel-size 2 --rows 1 --sweep-rows 1
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from gemma4serve_kernels import _common
from gemma4serve_kernels.activation import gelu_tanh_mul
from gemma4serve_kernels.gemv import gemv, gemv_mlp, mlp_down_config, splits_for

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step import copy_bandwidth, replay_seconds  # noqa: E402

LAYERS, H, Q, INTERMEDIATE = 60, 5376, 8192, 21504


def layer_shapes(tp: int) -> dict[str, tuple[int, int]]:
    """(N, K) of one rank's projections of a sliding layer: qkv and gate_up split N, o_proj and
    down split K."""
    return {
        "qkv": (2 * Q // tp, H),
        "o_proj": (H, Q // tp),
        "gate_up": (2 * INTERMEDIATE // tp, H),
        "down": (H, INTERMEDIATE // tp),
    }


SWEEP_ONLY = {  # the LM head, and the 31B drafter's projections (H 1024, I 8192) and tied head
    "lm_head": (262144, H),
    "draft pre": (1024, 2 * H),
    "draft q": (8192, 1024),
    "draft o": (1024, 8192),
    "draft gate_up": (16384, 1024),
    "draft down": (1024, 8192),
    "draft post": (H, 1024),
    "draft lm_head": (262144, 1024),
}
CONFIGS = list(itertools.product((32, 64, 128), (128, 256), (2, 4), (3, 4, 5)))
MLP_DOWN_CONFIGS = list(itertools.product((32, 64, 128), (256,), (4,), (3, 4), (3, 4, 6, 7, 12)))


def replay_ms(fn, iters: int = 10) -> float:
    """`replay_seconds` in ms."""
    return replay_seconds(fn, iters) * 1e3


def mlp_table(hidden: int, inter: int, M: int, bw: float) -> None:
    """The MLP pair over 60 layers' weights (gate_up + GELU·up, then down), timed three ways.

    As two GEMVs, and as gemv_mlp with its default and with each swept down tile.
    """
    ws = [
        (
            torch.empty(2 * inter, hidden, dtype=torch.bfloat16, device="cuda").normal_(0, 0.02),
            torch.empty(hidden, inter, dtype=torch.bfloat16, device="cuda").normal_(0, 0.02),
        )
        for _ in range(LAYERS)
    ]
    x = torch.randn(M, hidden, dtype=torch.bfloat16, device="cuda") * 0.1
    nbytes = LAYERS * 3 * inter * hidden * 2
    us = lambda ms: ms * 1e3 / LAYERS  # noqa: E731

    def row(label, ms):
        share = 100 * nbytes / bw / (ms / 1e3)
        print(f"| {label} | {us(ms):.1f} | {nbytes / ms / 1e9:.2f} | {share:.1f}% |", flush=True)

    print(
        f"\nMLP pair H {hidden}, I {inter} (gate_up with GELU·up, then down), M = {M}, "
        f"µs per layer; roofline {us(nbytes / bw * 1e3):.1f} µs"
    )
    print("| impl (down: BN, BK, warps, stages, splits) | µs | TB/s | % of roofline |")
    print("|---|---|---|---|")
    row(
        "two GEMVs (gemv_config)",
        replay_ms(lambda: [gemv(gemv(x, gu, glu=True), d) for gu, d in ws]),
    )
    row(
        f"gemv_mlp {mlp_down_config(hidden, inter, x.device)}",
        replay_ms(lambda: [gemv_mlp(x, gu, d) for gu, d in ws]),
    )
    ref = gemv(gemv(x, ws[0][0], glu=True), ws[0][1]).float()
    results = []
    for cfg in MLP_DOWN_CONFIGS:
        assert (gemv_mlp(x, *ws[0], config=cfg).float() - ref).norm() <= 1e-2 * ref.norm()
        results.append((replay_ms(lambda: [gemv_mlp(x, gu, d, config=cfg) for gu, d in ws]), cfg))
    for t, cfg in sorted(results)[:6]:
        row(f"gemv_mlp {cfg}", t)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 5, 8, 16])
    parser.add_argument("--sweep-rows", type=int, default=1)
    parser.add_argument("--skip-shapes", action="store_true", help="no per-shape tile sweep")
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="one rank's shapes (the sweep then leaves out the LM head and the drafter)",
    )
    args = parser.parse_args()
    tp = args.tensor_parallel_size
    shapes = layer_shapes(tp)
    q_rank = Q // tp
    torch.manual_seed(0)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    bw = copy_bandwidth(torch.device("cuda"))
    print(f"# copy bandwidth {bw / 1e12:.2f} TB/s")
    weights = {
        name: [
            torch.empty(n, k, dtype=torch.bfloat16, device="cuda").normal_(0, 0.02)
            for _ in range(LAYERS)
        ]
        for name, (n, k) in shapes.items()
    }
    per_layer = sum(n * k * 2 for n, k in shapes.values())

    # Tile sweep: each shape's GEMV over the 60 layers' weights, PDL on (as in the engine).
    M = args.sweep_rows
    print(
        "\n| shape | M | cuBLAS µs | cuBLAS TB/s | gemv µs (gemv_config) | gemv TB/s "
        "| best µs | best TB/s | best (BN, BK, warps, stages, splits) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    swept = {} if args.skip_shapes else {**shapes, **(SWEEP_ONLY if tp == 1 else {})}
    for name, (n, k) in swept.items():
        # Enough copies of the weight (>= 3 GB in all, or the 60 layers) that no read comes from L2.
        ws = (
            weights[name]
            if name in weights
            else [
                torch.empty(n, k, dtype=torch.bfloat16, device="cuda").normal_(0, 0.02)
                for _ in range(max(2, min(LAYERS, -(-3 * 10**9 // (n * k * 2)))))
            ]
        )
        x = torch.randn(M, k, dtype=torch.bfloat16, device="cuda")
        ref = F.linear(x, ws[0]).float()
        t_cublas = replay_ms(lambda: [F.linear(x, wi) for wi in ws])
        t_default = replay_ms(lambda: [gemv(x, wi) for wi in ws])
        results = []
        # each tile with its K splits and with two (a grid of 1-2 waves evens out its SMs' share)
        splits = lambda c: {splits_for(triton.cdiv(n, c[0]), k, x.device), 2}  # noqa: E731
        for cfg in [(*c, split) for c in CONFIGS for split in sorted(splits(c))]:
            try:
                y = gemv(x, ws[0], config=cfg).float()
            except Exception as e:  # a tile that does not fit (shared memory): skip it
                print(f"  skip {cfg}: {type(e).__name__}")
                continue
            assert (y - ref).norm() <= 1e-2 * ref.norm(), (name, cfg)
            results.append((replay_ms(lambda: [gemv(x, wi, config=cfg) for wi in ws]), cfg))
        t, cfg = min(results)
        us = lambda ms: ms * 1e3 / len(ws)  # noqa: E731
        tb = lambda ms: n * k * 2 * len(ws) / ms / 1e9  # noqa: E731
        print(
            f"| {name} | {M} | {us(t_cublas):.1f} | {tb(t_cublas):.2f} "
            f"| {us(t_default):.1f} | {tb(t_default):.2f} "
            f"| {us(t):.1f} | {tb(t):.2f} | {cfg} |",
            flush=True,
        )

    # the 31B's MLP, its drafter's (one rank's share of the intermediate under TP)
    for hidden, inter in ((H, INTERMEDIATE // tp), (1024, 8192 // tp)):
        mlp_table(hidden, inter, M, bw)

    def chain(impl: str, x0: torch.Tensor):
        lin = F.linear if impl == "cuBLAS" else gemv

        def gate_up(x, wi):  # the GEMV does GELU·up in its epilogue, as in the engine
            return gelu_tanh_mul(F.linear(x, wi)) if impl == "cuBLAS" else gemv(x, wi, glu=True)

        def run():
            _common.PDL_ENABLED = impl.endswith("PDL")
            h = x0
            for i in range(LAYERS):
                qkv = lin(h, weights["qkv"][i])
                o = lin(qkv[:, :q_rank], weights["o_proj"][i])
                if impl == "gemv_mlp + PDL":
                    h = gemv_mlp(o, weights["gate_up"][i], weights["down"][i])
                else:
                    h = lin(gate_up(o, weights["gate_up"][i]), weights["down"][i])
            return h

        return run

    nbytes = per_layer * LAYERS
    print(
        f"\n60-layer chain (qkv, o_proj, gate_up, gelu, down) of rank 0 of {tp}, "
        f"{nbytes / 1e9:.1f} GB of weights; "
        f"roofline {nbytes / bw * 1e3:.2f} ms = bytes / copy bandwidth"
    )
    print("| M | impl | ms | TB/s | % of roofline |")
    print("|---|---|---|---|---|")
    for M in args.rows:
        x0 = torch.randn(M, H, dtype=torch.bfloat16, device="cuda") * 0.1
        for impl in ("cuBLAS", "gemv", "gemv + PDL", "gemv_mlp + PDL"):
            t = replay_ms(chain(impl, x0))
            share = 100 * nbytes / bw / (t / 1e3)
            print(f"| {M} | {impl} | {t:.2f} | {nbytes / t / 1e9:.2f} | {share:.1f}% |", flush=True)
    _common.PDL_ENABLED = True


if __name__ == "__main__":
    main()
