"""The drafter's MLPs under tensor parallelism: replicated (full width on every rank) or split.

A replicated drafter could only drop its MLPs' all-reduces: its queries read the rank's own KV
heads, so its attention stays split either way. This times the drafter's MLPs (the four 1024 ->
2 x 8192 -> 1024 of the 31B assistant by default) at full width and at 1/N of it, as one chain of
`gemv_mlp` calls replayed from a CUDA graph, next to the bandwidth roofline of their weights.
Split wins where its time plus one fused all-reduce + norm per MLP (`bench_allreduce.py --ranks N`
on a multi-GPU machine) stays below the full width's time plus one norm per MLP.

    python bench/bench_drafter_mlp.py [--draft configs/gemma-4-31B-it-assistant] [--ranks 2]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from gemma4serve.config import load_config
from gemma4serve_kernels.gemv import gemv_mlp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step import copy_bandwidth, replay_seconds  # noqa: E402

CHAINS = 20  # MLP chains per graph replay: a replay's launch cost is spread over them


def time_chain(hidden: int, width: int, layers: int, rows: int) -> tuple[float, int]:
    """(µs per chain of `layers` MLPs of this width, weight bytes of one chain)."""
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    weights = [
        (torch.randn(2 * width, hidden, **bf16) * 0.02, torch.randn(hidden, width, **bf16) * 0.02)
        for _ in range(layers)
    ]
    x = torch.randn(rows, hidden, **bf16)

    def chain():
        h = x
        for _ in range(CHAINS):
            for gate_up, down in weights:
                h = gemv_mlp(h, gate_up, down)

    nbytes = sum(gate_up.numel() + down.numel() for gate_up, down in weights) * 2
    return replay_seconds(chain) / CHAINS * 1e6, nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--draft", default="configs/gemma-4-31B-it-assistant")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    cli = parser.parse_args()
    text = load_config(cli.draft).text
    bandwidth = copy_bandwidth(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e9:,.0f} GB/s")
    print(f"{len(text.layers)} MLPs of {text.hidden_size} -> 2 x {text.intermediate_size}")
    print("rows  width   us / chain  roofline us  % roof")
    for rows in cli.rows:
        for width in (text.intermediate_size, text.intermediate_size // cli.ranks):
            us, nbytes = time_chain(text.hidden_size, width, len(text.layers), rows)
            roof = nbytes / bandwidth * 1e6
            print(f"{rows:4d} {width:6d} {us:12.1f} {roof:12.1f} {100 * roof / us:7.1f}")


if __name__ == "__main__":
    main()
