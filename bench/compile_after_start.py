"""Kernel variants that load after start-up, on a real model's shapes, over varied requests.

A Triton variant compiled (or loaded from disk) while serving stalls every running request; the
warm-up and graph capture are meant to load them all. This starts the engine on --load-format
dummy weights through the offline `LLM` API, counts every kernel module's loaded variants, then
runs requests of many shapes (lengths up to --max-model-len, prompt logprobs over a long prefix,
sampling settings, n = 2, JSON-object outputs, many sequences at once, a long prompt beside short
ones) and prints, per case, any variant that loaded after start (rank 0's, under tensor
parallelism: every rank launches the same shapes).

    python bench/compile_after_start.py --model configs/gemma-4-31B-it \\
        --draft configs/gemma-4-31B-it-assistant
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from synthetic_tokenizer import write_synthetic_tokenizer  # noqa: E402

from gemma4serve import LLM, SamplingParams  # noqa: E402
from gemma4serve.cli import setup_logging  # noqa: E402
from gemma4serve.structured.spec import StructuredOutputsParams  # noqa: E402
from gemma4serve_kernels._common import jit_kernels  # noqa: E402


def loaded_variants() -> dict[str, int]:
    """Each kernel's loaded variants."""
    return {f.__name__: sum(len(c[0]) for c in f.device_caches.values()) for f in jit_kernels()}


def cases(longest: int, rng: random.Random) -> dict[str, list[tuple[list, SamplingParams]]]:
    def prompt(n: int) -> list[int]:
        return [rng.randrange(1000, 200_000) for _ in range(n)]

    def greedy(tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)

    long = longest * 9 // 16
    lengths = [n for n in (1, 2, 17, 100, 1000, 2049, 5000, long, longest * 3 // 4) if n < longest]
    sampled = SamplingParams(
        max_tokens=12, temperature=0.8, top_p=0.9, top_k=50, seed=1, n=2, logprobs=3
    )
    return {
        "greedy prompts of many lengths": [([prompt(n)], greedy(4)) for n in lengths],
        "a batch of mixed lengths": [([prompt(n) for n in (5, 900, 2500, 40, 3)], greedy(8))],
        "prompt logprobs over a long prefix": [
            ([prompt(long)], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))
        ],
        "short prompts' logprobs": [
            ([prompt(n) for n in lens], SamplingParams(max_tokens=2, prompt_logprobs=0))
            for lens in ([9], [12], [16], [5, 14], [40, 9, 9])
        ],
        "sampling, n = 2, logprobs": [([prompt(300), prompt(1200)], sampled)],
        "a repetition penalty": [
            ([prompt(200)] * 3, SamplingParams(max_tokens=10, repetition_penalty=1.2))
        ],
        "JSON objects": [
            (
                [prompt(50), prompt(70)],
                SamplingParams(
                    max_tokens=16, structured_outputs=StructuredOutputsParams(json_object=True)
                ),
            )
        ],
        "40 short prompts at once": [
            ([prompt(rng.randrange(3, 60)) for _ in range(40)], greedy(6))
        ],
        "a long prompt beside 20 short ones": [
            ([prompt(long + 500)] + [prompt(20) for _ in range(20)], greedy(6))
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="configs/gemma-4-31B-it")
    parser.add_argument("--draft", help="the drafter's config or checkpoint (default: none)")
    parser.add_argument("--max-model-len", type=int, default=16384)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    args = parser.parse_args()
    setup_logging("info")  # the start's steps and their times
    tokenizer = Path(tempfile.mkdtemp(prefix="g4s-tokenizer-"))
    write_synthetic_tokenizer(tokenizer, 262144)
    start = time.monotonic()
    llm = LLM(
        args.model,
        draft=args.draft,
        device="cuda",
        dtype="bfloat16",
        load_format="dummy",
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        tensor_parallel_size=args.tensor_parallel_size,
        tokenizer=str(tokenizer),
    )
    print(f"started in {time.monotonic() - start:.1f} s: {sum(loaded_variants().values())} "
          "kernel variants loaded")  # fmt: skip
    late = 0
    for name, runs in cases(args.max_model_len, random.Random(0)).items():
        before, start = loaded_variants(), time.monotonic()
        for prompts, params in runs:
            llm.generate(prompts, params)
        after = loaded_variants()
        grew = {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}
        late += sum(grew.values())
        print(f"{name}: {time.monotonic() - start:.1f} s, loaded after start: {grew or 'none'}")
    print("every variant loaded at start" if not late else f"{late} variants loaded while serving")
    sys.exit(1 if late else 0)


if __name__ == "__main__":
    main()
