"""How many requests of a given length the KV arena holds at once, on this GPU with the defaults.

Builds the engine as `gemma4serve` would (dummy weights of the real shapes, the default memory
budget) and then fills its arena with sequences in steady decoding: each maps its full-layer rows
for the whole request and the sliding rows one reader can still reach, as the scheduler maps them.

python bench/bench_capacity.py --model configs/gemma-4-31B-it \\
    --draft configs/gemma-4-31B-it-assistant --lengths 4096 32768
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gemma4serve.engine.args import EngineArgs  # noqa: E402
from gemma4serve.engine.engine import LLMEngine  # noqa: E402
from gemma4serve.engine.sequence import Sequence  # noqa: E402
from gemma4serve.sampling_params import SamplingParams  # noqa: E402


def fill(engine: LLMEngine, length: int) -> int:
    """Sequences of `length` tokens, each one decode step ahead, until the arena is full."""
    k = engine.num_draft_tokens
    sequences = []
    while True:
        seq = Sequence(
            request_id=f"fill-{len(sequences)}",
            index=0,
            token_ids=[0] * length,
            num_prompt=length,
            params=SamplingParams(),
            seed=0,
            arrival=len(sequences),
            max_len=length + k + 1,
        )
        # Two steps of k + 1 rows past the context, as async scheduling maps them.
        if not engine.kv.can_grow(seq, length - 1, length + 2 * (k + 1)):
            break
        engine.kv.grow(seq, length - 1, length + 2 * (k + 1))
        sequences.append(seq)
    for seq in sequences:
        engine.kv.free(seq, committed=0)
    return len(sequences)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="configs/gemma-4-31B-it")
    parser.add_argument("--draft", default="configs/gemma-4-31B-it-assistant")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.90)
    args = parser.parse_args()
    print(f"# {' '.join(sys.argv)}")
    print(f"# {torch.cuda.get_device_name()}, {datetime.date.today()}, torch {torch.__version__}")
    engine = LLMEngine(
        EngineArgs(
            model=args.model,
            draft=args.draft,
            load_format="dummy",
            gpu_memory_utilization=args.gpu_memory_utilization,
        )
    )
    plan = engine.state.kv_plan
    total = torch.cuda.get_device_properties(0).total_memory
    print(
        f"KV arena: {plan.bytes / 2**30:.2f} GiB of {total / 2**30:.1f} GiB, "
        f"{plan.num_pages - 1} pages of {plan.page_bytes / 2**20:.2f} MiB, "
        f"positions per page {plan.page_tokens}, max_model_len {engine.max_model_len}"
    )
    print("| request tokens | requests at once (filled) | computed (plan) |")
    print("|---|---|---|")
    keep = plan.sliding_keep + 2 * (engine.num_draft_tokens + 1)
    for length in args.lengths:
        if length > engine.max_model_len:
            print(f"| {length} | over max_model_len | - |")
            continue
        print(f"| {length} | {fill(engine, length)} | {plan.max_concurrency(length, keep):.1f} |")


if __name__ == "__main__":
    main()
