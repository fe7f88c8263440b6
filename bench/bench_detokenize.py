"""Host time the OutputProcessor takes per engine step: detokenization, stop strings and the
cumulative fields, for `--batch` running requests that each get `--tokens` new tokens a step (MTP
gives ~3). This is the work the server process does for every engine step; the engine process
does none of it.

  python bench/synthetic_tokenizer.py /tmp/tok262   # a tokenizer with Gemma 4's vocabulary size
  python bench/bench_detokenize.py --tokenizer /tmp/tok262 --batch 32 --tokens 3
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gemma4serve.engine.output_processor import OutputProcessor  # noqa: E402
from gemma4serve.engine.outputs import CompletionOutput, RequestOutput  # noqa: E402
from gemma4serve.sampling_params import SamplingParams  # noqa: E402
from gemma4serve.tokenizer import Tokenizer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", required=True, help="a folder with tokenizer.json")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=3, help="new tokens per request per step")
    parser.add_argument("--steps", type=int, default=80)
    args = parser.parse_args()
    tokenizer = Tokenizer.from_dir(args.tokenizer)
    rng, k = random.Random(0), args.tokens
    for label, stop in (("no stop strings", []), ("two stop strings", ["\n\n", "User:"])):
        processor = OutputProcessor(tokenizer)
        params = SamplingParams(max_tokens=args.steps * args.tokens, stop=stop)
        for request in range(args.batch):
            processor.add_request(f"r{request}", [2], params)
        steps = [
            [
                RequestOutput(
                    f"r{request}",
                    [],
                    [CompletionOutput(0, new_token_ids=rng.sample(range(1000, 200_000), k))],
                    finished=False,
                )
                for request in range(args.batch)
            ]
            for _ in range(args.steps)
        ]
        start = time.perf_counter()
        for outputs in steps:
            for output in outputs:
                processor.process(output)
        seconds = (time.perf_counter() - start) / args.steps
        per_token = seconds / (args.batch * args.tokens)
        print(
            f"{label}: {seconds * 1e3:.3f} ms per step of {args.batch} requests x {args.tokens} "
            f"tokens ({per_token * 1e6:.2f} us per token)"
        )


if __name__ == "__main__":
    main()
