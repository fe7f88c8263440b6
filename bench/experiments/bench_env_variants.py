"""Batch-1 decode step (31B, captured graph) under environment-variable variants read at launch time."""
import json
import os
import sys

sys.path.insert(0, "bench/experiments")
from bench_attn_variants import LLMEngine, EngineArgs, step_ms  # noqa

VARIANTS = [{}] + [json.loads(a) for a in sys.argv[1:]]


def main():
    engine = LLMEngine(EngineArgs(model="configs/gemma-4-31B-it", draft="", load_format="dummy", device="cuda",
                                  dtype="bfloat16", max_num_seqs=8, max_num_batched_tokens=64, max_model_len=1400,
                                  enforce_eager=True))
    res = {}
    keys = {k for v in VARIANTS for k in v}
    for rnd in range(2):
        for i, v in enumerate(VARIANTS):
            for k in keys:
                os.environ.pop(k, None)
            os.environ.update(v)
            for B in (1, 8):
                res.setdefault((i, B), []).append(step_ms(engine, B, 0))
                print(f"round {rnd} b{B} {v}: {res[(i, B)][-1]:.3f} ms", flush=True)
    print("| variant | b1 | b8 |")
    for i, v in enumerate(VARIANTS):
        print(f"| {v or 'current'} | {min(res[(i, 1)]):.3f} | {min(res[(i, 8)]):.3f} |")


if __name__ == "__main__":
    main()
