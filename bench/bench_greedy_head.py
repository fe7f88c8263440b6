"""The greedy LM head against the full one (GEMV + softcap + argmax).

Measured at the head shapes of the 31B, its drafter, the 26B-A4B and the E2B. Both are timed as
CUDA-graph replays with PDL, as the engine runs them; the roofline of the full head is its bf16
bytes, of the greedy head its int8 copy's bytes (the few candidate rows it re-reads in bf16 are
left out), over the measured copy bandwidth. Then each kernel of the greedy head alone (PDL off,
torch profiler), and a sweep of the screen's tiles and of the exact kernel's rows per program and
pipeline stages. Past the GEMV's 16 rows (`--many-rows`), the served path: cuBLAS's bf16 logits,
then `first_max` (the same softcap table, read at each chunk's largest logit), against torch's
softcap and argmax; the roofline of `first_max` alone is the logits' bytes.

  python bench/bench_greedy_head.py [--rows 1 5 16] [--many-rows 32 96 160] [--sweep]
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from gemma4serve_kernels import (
    _common,
    first_max,
    floor_table,
    gemv,
    greedy_head,
    quantize_rows,
    value_table,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gemv import replay_ms  # noqa: E402
from bench_step import copy_bandwidth  # noqa: E402

head_module = importlib.import_module("gemma4serve_kernels.greedy_head")
HEADS = {
    "31B": (262144, 5376),
    "31B drafter": (262144, 1024),
    "26B-A4B": (262144, 2816),
    "E2B": (262144, 1536),
}
SCREENS = [
    (128, 256, 4, 3),
    (128, 256, 4, 4),
    (256, 256, 8, 3),
    (128, 512, 4, 3),
    (64, 256, 4, 4),
    (64, 512, 4, 3),
]
EXACTS = [(512, 3), (256, 3), (1024, 3), (1024, 4)]  # (rows per program, stages)


def softcap(v):
    return torch.tanh(v / 30.0) * 30.0


def per_kernel_us(fn) -> str:
    """Each kernel's mean device time (PDL off, so a kernel's time is its own work)."""
    _common.PDL_ENABLED = False
    try:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                fn()
            torch.cuda.synchronize()
    finally:
        _common.PDL_ENABLED = True
    return ", ".join(
        f"{event.key.split('_kernel')[0].lstrip('_')} {event.device_time_total / 10:.1f}"
        for event in prof.key_averages()
        if event.device_time_total > 0
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 5, 16])
    parser.add_argument("--many-rows", type=int, nargs="*", default=[32, 96, 160])
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="screen tiles and exact-kernel shapes (31B head, M 1 and 5)",
    )
    args = parser.parse_args()
    bw = copy_bandwidth("cuda")
    print(
        f"{torch.cuda.get_device_name()}, copy bandwidth {bw / 1e9:.0f} GB/s; "
        "times in us (graph replay, PDL)\n"
    )
    print(
        "| head | M | full head | full roofline | greedy head | greedy roofline | greedy / full | "
        "kernels alone (PDL off) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    weights = {}
    for name, (N, K) in HEADS.items():
        w = (torch.randn(N, K, device="cuda") * 0.02).to(torch.bfloat16)
        q, scale = quantize_rows(w)
        lut = value_table(softcap, torch.device("cuda"))
        weights[name] = (w, q, scale, lut, floor_table(lut))
        for M in args.rows:
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            full = replay_ms(lambda: softcap(gemv(x, w)).argmax(-1)) * 1e3
            fast = replay_ms(lambda: greedy_head(x, w, q, scale, lut)) * 1e3
            assert torch.equal(greedy_head(x, w, q, scale, lut)[0], softcap(gemv(x, w)).argmax(-1))
            full_roof, greedy_roof = N * K * 2 / bw * 1e6, N * K / bw * 1e6
            kernels = per_kernel_us(lambda: greedy_head(x, w, q, scale, lut))
            print(
                f"| {name} | {M} | {full:.1f} | {full_roof:.1f} | {fast:.1f} | {greedy_roof:.1f} | "
                f"{fast / full:.2f} | {kernels} |",
                flush=True,
            )
    if args.many_rows:
        many_rows_table(weights, args.many_rows, bw)
    if not args.sweep:
        return
    w, q, scale, lut, _ = weights["31B"]
    print(
        "\n31B head, greedy head us by screen tile (BN, BK, warps, stages) "
        "and exact kernel (rows per program, stages):"
    )
    print("| screen | exact | M = 1 | M = 5 |\n|---|---|---|---|")
    default = (head_module.ROWS_PER_PROGRAM, head_module.EXACT_STAGES)
    runs = [(tile, default) for tile in SCREENS]
    runs += [(SCREENS[0], exact) for exact in EXACTS if exact != default]
    # The same inputs for all runs.
    xs = {M: torch.randn(M, w.shape[1], device="cuda").to(torch.bfloat16) for M in (1, 5)}
    for screen, (rows, stages) in runs:
        head_module.ROWS_PER_PROGRAM, head_module.EXACT_STAGES = rows, stages
        times = []
        for x in xs.values():
            try:
                replay = replay_ms(lambda: greedy_head(x, w, q, scale, lut, screen=screen))
                times.append(f"{replay * 1e3:.1f}")
            except Exception as e:  # a tile that does not fit shared memory
                times.append(type(e).__name__)
        print(f"| {screen} | {rows}, {stages} | {' | '.join(times)} |", flush=True)
    head_module.ROWS_PER_PROGRAM, head_module.EXACT_STAGES = default


def many_rows_table(weights: dict, rows: list[int], bw: float) -> None:
    """The head past the GEMV's rows: cuBLAS's logits, then first_max (as served) or torch."""
    print(
        "\n| head | M | cuBLAS + first_max | cuBLAS + torch softcap, argmax | first_max alone | "
        "its roofline | kernels alone (PDL off) |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, (w, _, _, lut, floor) in weights.items():
        for M in rows:
            x = torch.randn(M, w.shape[1], device=w.device).to(torch.bfloat16)
            logits = F.linear(x, w)
            tables = dict(table=lut, floor=floor)
            assert torch.equal(first_max(logits, **tables)[0], softcap(logits).argmax(-1))
            served = replay_ms(lambda: first_max(F.linear(x, w), **tables)) * 1e3
            reference = replay_ms(lambda: softcap(F.linear(x, w)).argmax(-1)) * 1e3
            alone = replay_ms(lambda: first_max(logits, **tables)) * 1e3
            kernels = per_kernel_us(lambda: first_max(logits, **tables))
            print(
                f"| {name} | {M} | {served:.1f} | {reference:.1f} | {alone:.1f} | "
                f"{logits.numel() * 2 / bw * 1e6:.1f} | {kernels} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
