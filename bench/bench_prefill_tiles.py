"""Prefill attention over a cached prefix: one chunk of R new rows reaching C positions, on the
64-row tiles against the 128-row ones (on the 512-wide heads, value columns split over two
programs), and which tiles `attention_config` takes with the context and without it.

    python bench/bench_prefill_tiles.py     # every model's full layers, the grid below
    python bench/bench_prefill_tiles.py --models gemma-4-26B-A4B-it --rows 2048 --contexts 8192

Times are replays from a CUDA graph (µs), K and V in a served arena (pages of every layer spread
over GiBs). The roofline is the launch's q·k and p·v FLOPs at the matmul rate this board holds
(an 8192³ matmul held 3 s: bench_offline.measure_matmul_flops).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import build_groups, served_arena, shapes_of  # noqa: E402
from bench_offline import measure_matmul_flops  # noqa: E402

from gemma4serve.config import load_config  # noqa: E402
from gemma4serve_kernels import attention_config, paged_attention  # noqa: E402

MODELS = ["gemma-4-31B-it", "gemma-4-26B-A4B-it", "gemma-4-E4B-it", "gemma-4-E2B-it"]


def tiles_name(cfg: dict) -> str:
    return f"{cfg['block_m']}-row" + (" split" if cfg["value_parts"] > 1 else "")


def graph_us(launch: tuple, tiles: dict) -> float:
    """One launch on `tiles`, replayed from a CUDA graph: µs."""
    out = torch.empty_like(launch[0])

    def run():
        paged_attention(*launch, out=out, config=tiles)

    run()  # compile outside the capture
    return do_bench_cudagraph(run, rep=30) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=MODELS, help="config names in configs/")
    parser.add_argument("--layers", default="full", help="full, sliding or both (comma)")
    parser.add_argument("--rows", default="512,1024,2048", help="the chunk's new rows")
    parser.add_argument("--contexts", default="0,4096,8192,32768", help="positions it reaches")
    parser.add_argument("--arena-gib", type=float, default=24)
    args = parser.parse_args()
    rate = measure_matmul_flops(torch.device("cuda"), torch.bfloat16)
    print(f"matmul rate for the roofline: {rate / 1e12:.0f} TFLOP/s (held 3 s)")
    print("model, layers, rows @ context: 64-row µs / 128-row µs (change); roofline µs; tiles "
          "taken without / with the context")  # fmt: skip
    for model in args.models:
        cfg = load_config(f"configs/{model}")
        shapes, arena = shapes_of(cfg), served_arena(cfg, args.arena_gib)
        for kind in args.layers.split(","):
            shape = shapes[kind]
            group = shape["nh"] // shape["nkv"]
            for rows in map(int, args.rows.split(",")):
                for context in map(int, args.contexts.split(",")):
                    context = max(context, rows)  # 0: the chunk alone
                    launch, _, flops = build_groups(shape, [(context, rows)], arena)
                    T = launch[0].shape[0]
                    narrow = attention_config(shape["hd"], group, T)
                    wide = attention_config(shape["hd"], group, T, 1 << 30, shape["nkv"])
                    times = {"narrow": graph_us(launch, narrow), "wide": graph_us(launch, wide)}
                    alone = attention_config(shape["hd"], group, T, T, shape["nkv"])
                    over = attention_config(shape["hd"], group, T, T, shape["nkv"], context)
                    print(
                        f"{model} {kind} {rows}@{context}: {times['narrow']:.1f} / "
                        f"{times['wide']:.1f} ({times['wide'] / times['narrow'] - 1:+.1%}); "
                        f"roof {flops / rate * 1e6:.1f}; {tiles_name(alone)} / {tiles_name(over)}",
                        flush=True,
                    )
        del arena
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
