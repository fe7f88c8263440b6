"""The elementwise kernels of a step at a model's shapes: bandwidth per row count, and per token.

A layer runs three kinds besides its GEMMs and attention: `qkv_epilogue` (q/k/v norms, RoPE, the
K/V write), `rmsnorm_residual_add` twice (after attention and after the MLP, each with the next
norm) and `gelu_tanh_mul`. Each is memory-bound, so the figure of merit is the bytes it must move
(inputs read once, outputs written once) over its time, against the copy bandwidth measured here.
A case runs over enough distinct buffers, back to back in one CUDA graph, that they do not fit in
L2 (as a step's layers do not). The last line of a row count sums the model's layers: µs of
elementwise work per token of a step that size (prompt chunks are 1024–2048 rows, a c = 32 verify
step 96).

    python bench/bench_elementwise.py --model configs/gemma-4-31B-it --rows 96 2048
    python bench/bench_elementwise.py --rows 2048 --sweep   # also the launch variants
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_step import copy_bandwidth, replay_seconds  # noqa: E402

from gemma4serve.config import FULL, SLIDING, load_config  # noqa: E402
from gemma4serve_kernels import gelu_tanh_times, qkv_epilogue, rmsnorm_residual_add  # noqa: E402

DT = torch.bfloat16
PAGE = 16
OUT_OF_L2_BYTES = 512 * 2**20  # the buffers a case cycles through


@dataclass
class Case:
    """One kernel at one shape: `make()` builds the buffers of one call and returns the call taking
    launch options; `bytes` is what one call must move."""

    name: str
    make: Callable[[], Callable[..., object]]
    bytes: int
    variants: list[dict]  # launch options of the sweep; {} is the kernel's own choice


def residual_case(hidden: int, rows: int, device) -> Case:
    def make():
        x, h = (torch.randn(rows, hidden, device=device, dtype=DT) for _ in range(2))
        w, w2 = (torch.rand(hidden, device=device, dtype=DT) for _ in range(2))
        scalar = torch.tensor([0.5], device=device, dtype=DT)
        return lambda **o: rmsnorm_residual_add(x, h, w, 1e-6, scalar, w2, **o)

    warps = [dict(num_warps=n) for n in (4, 8, 16, 32)]
    return Case(f"residual_norm [{rows}, {hidden}]", make, 4 * rows * hidden * 2, warps)


def qkv_case(kind: str, nh: int, nkv: int, hd: int, k_eq_v: bool, rows: int, device) -> Case:
    width = (nh + nkv * (1 if k_eq_v else 2)) * hd

    def make():
        qkv = torch.randn(rows, width, device=device, dtype=DT)
        qw, kw = (torch.rand(hd, device=device, dtype=DT) for _ in range(2))
        cos, sin = (torch.rand(rows, hd, device=device, dtype=DT) for _ in range(2))
        pages = -(-rows // PAGE)
        k_cache, v_cache = (
            torch.zeros(pages, PAGE, nkv, hd, device=device, dtype=DT) for _ in range(2)
        )
        slots = torch.arange(rows, device=device)
        return lambda **o: qkv_epilogue(
            qkv, qw, kw, cos, sin, 1e-6, k_cache, v_cache, slots, nh, nkv, k_eq_v, **o
        )

    moved = rows * (width + nh * hd + 2 * nkv * hd + 2 * hd) * 2  # qkv, cos/sin in; q, K, V out
    heads = [h for h in (1, 2, 4, 8, 16) if nh % h == 0]
    variants = [
        dict(heads_per_program=h, num_warps=n) for h, n in itertools.product(heads, (1, 2, 4, 8))
    ]
    return Case(f"qkv_epilogue {kind} [{rows}, {width}]", make, moved, variants)


def gelu_case(inter: int, rows: int, device) -> Case:
    def make():
        gate_up = torch.randn(rows, 2 * inter, device=device, dtype=DT)
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
        return lambda **o: gelu_tanh_times(gate, up, **o)

    launches = ((512, 1), (512, 2), (1024, 2), (1024, 4), (2048, 4), (2048, 8), (4096, 8))
    variants = [dict(block=b, num_warps=n) for b, n in launches]
    return Case(f"gelu_mul [{rows}, {inter}]", make, 3 * rows * inter * 2, variants)


def seconds(case: Case, options: dict) -> float:
    """Seconds per call, replayed from a CUDA graph over buffers that together exceed L2."""
    copies = max(2, min(64, -(-OUT_OF_L2_BYTES // case.bytes)))
    calls = [case.make() for _ in range(copies)]

    def run():
        for call in calls:
            call(**options)

    return replay_seconds(run, iters=20) / copies


def timed(case: Case, options: dict) -> float:
    """`seconds`, or infinity where the variant does not compile (registers, shared memory)."""
    try:
        return seconds(case, options)
    except Exception:
        return float("inf")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="configs/gemma-4-31B-it")
    parser.add_argument("--rows", type=int, nargs="+", default=[96, 1024, 2048, 4096])
    parser.add_argument("--sweep", action="store_true", help="also time the launch variants")
    cli = parser.parse_args()
    device = torch.device("cuda")
    cfg = load_config(cli.model)
    bandwidth = copy_bandwidth(device)
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e9:,.0f} GB/s")
    # The distinct layer shapes and how many layers have each (KV-shared layers write no K/V, but
    # their epilogue is timed as a producer's: a small overcount on the E models).
    kinds = Counter(
        (layer.kind, layer.num_kv_heads, layer.head_dim, layer.k_eq_v) for layer in cfg.layers
    )
    widths = Counter(layer.mlp_width for layer in cfg.layers)
    for rows in cli.rows:
        cases = [(residual_case(cfg.hidden_size, rows, device), 2 * cfg.num_layers)]
        for (kind, nkv, hd, k_eq_v), count in kinds.items():
            name = {SLIDING: "sliding", FULL: "full"}[kind]
            case = qkv_case(name, cfg.num_heads, nkv, hd, k_eq_v, rows, device)
            cases.append((case, count))
        for inter, count in widths.items():
            cases.append((gelu_case(inter, rows, device), count))
        total = 0.0
        for case, count in cases:
            own = seconds(case, {})
            total += own * count
            line = f"{case.name:40s} x{count:3d}: {own * 1e6:8.1f} us {rate(case, own, bandwidth)}"
            if cli.sweep:
                best, options = min(
                    ((timed(case, o), o) for o in case.variants), key=lambda pair: pair[0]
                )
                line += f" | best {best * 1e6:8.1f} us {rate(case, best, bandwidth)} {options}"
            print(line, flush=True)
            torch.cuda.empty_cache()
        print(f"{rows} rows: {total / rows * 1e6:.2f} us of elementwise kernels a token\n")


def rate(case: Case, elapsed: float, bandwidth: float) -> str:
    achieved = case.bytes / elapsed
    return f"({achieved / 1e9:6,.0f} GB/s, {100 * achieved / bandwidth:3.0f}%)"


if __name__ == "__main__":
    main()
