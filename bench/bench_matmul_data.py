"""Whether the values a matmul multiplies change its rate at the board's power cap.

A prompt step's GEMMs hold an H200 at its 700 W cap, where the clock follows the power the tensor
cores draw, and that power follows how many operand bits toggle. Dummy weights differ between
servers: ours are N(0, 0.02) with norm scales near 1 (`gemma4serve/weights/dummy.py`), vLLM's
`--load-format dummy` draws every parameter uniform in +-1e-3 (norm scales included, so the GEMMs'
inputs shrink too). This holds the 31B's fused gate/up projection over a 2048-token step with
each kind of values, --rounds times in turn, and prints the rate over the second half of each
hold with the SM clock and board power beside it. All zeros bound what the data can change.

    python bench/bench_matmul_data.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_offline import held_calls_per_second  # noqa: E402
from gpu_power import PowerSampler  # noqa: E402


def operands(kind: str, rows: int, hidden: int, out: int, generator: torch.Generator):
    """(normed input x scale, weight) in bf16 for one kind of dummy values."""
    dev = generator.device
    normed = torch.randn(rows, hidden, device=dev, generator=generator)  # an RMSNorm's output
    if kind == "zeros":
        zeros = dict(device=dev, dtype=torch.bfloat16)
        return torch.zeros(rows, hidden, **zeros), torch.zeros(out, hidden, **zeros)
    if kind == "ours":
        weight = torch.randn(out, hidden, device=dev, generator=generator) * 0.02
        scale = torch.empty(hidden, device=dev).uniform_(0.9, 1.1, generator=generator)
    elif kind == "vllm":
        weight = torch.empty(out, hidden, device=dev).uniform_(-1e-3, 1e-3, generator=generator)
        scale = torch.empty(hidden, device=dev).uniform_(-1e-3, 1e-3, generator=generator)
    else:
        raise ValueError(kind)
    return (normed * scale).bfloat16(), weight.bfloat16()


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=5376)  # the 31B's
    p.add_argument("--out", type=int, default=2 * 21504)  # its fused gate/up
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    generator = torch.Generator(device="cuda")
    generator.manual_seed(0)
    flops = 2 * args.rows * args.hidden * args.out
    for round_index in range(args.rounds):
        for kind in ("ours", "vllm", "zeros"):
            x, weight = operands(kind, args.rows, args.hidden, args.out, generator)
            with PowerSampler(devices=1) as power:
                rate = flops * held_calls_per_second(lambda: F.linear(x, weight), x.device)
            line = power.summary.line() if power.summary else "not sampled"
            print(f"round {round_index} {kind:6s} {rate / 1e12:6.1f} TFLOP/s held; {line}")


if __name__ == "__main__":
    main()
