"""Batch-1 decode step (31B, captured graph) under attention split settings given by environment variables read
at launch (EXP_SPLITS_S / _F, EXP_MINKEYS_*, EXP_BN_*, EXP_STAGES_*; S = sliding, F = full layers)."""
import os
import sys

sys.path.insert(0, "bench/experiments")
from bench_attn_variants import LLMEngine, EngineArgs, step_ms  # noqa

VARIANTS = [
    {},
    dict(EXP_SPLITS_S="16", EXP_STAGES_S="3"),
    dict(EXP_SPLITS_S="16", EXP_STAGES_S="4"),
    dict(EXP_SPLITS_S="17", EXP_STAGES_S="2"),
    dict(EXP_SPLITS_S="64", EXP_MINKEYS_S="32", EXP_STAGES_S="2"),
    dict(EXP_SPLITS_S="9", EXP_MINKEYS_S="64", EXP_BN_S="64", EXP_STAGES_S="2"),
    dict(EXP_SPLITS_S="64", EXP_MINKEYS_S="64", EXP_BN_S="64", EXP_STAGES_S="2"),
    dict(EXP_SPLITS_F="64", EXP_MINKEYS_F="32"),
    dict(EXP_SPLITS_F="64", EXP_MINKEYS_F="32", EXP_STAGES_F="2"),
    dict(EXP_SPLITS_F="16", EXP_MINKEYS_F="32", EXP_STAGES_F="4"),
]


def main():
    engine = LLMEngine(EngineArgs(model="configs/gemma-4-31B-it", draft="", load_format="dummy", device="cuda",
                                  dtype="bfloat16", max_num_seqs=1, max_num_batched_tokens=64, max_model_len=1400,
                                  enforce_eager=True))
    ctxs = [int(c) for c in (sys.argv[1:] or ["1128"])]
    res = {}
    keys = {k for v in VARIANTS for k in v}
    for rnd in range(2):
        for i, v in enumerate(VARIANTS):
            for k in keys:
                os.environ.pop(k, None)
            os.environ.update(v)
            for c in ctxs:
                res.setdefault((i, c), []).append(step_ms(engine, 1, 0, c))
                print(f"round {rnd} ctx {c} {v}: {res[(i, c)][-1]:.3f} ms", flush=True)
    print("| variant | " + " | ".join(f"ctx {c}" for c in ctxs) + " |")
    for i, v in enumerate(VARIANTS):
        print(f"| {v or 'current'} | " + " | ".join(f"{min(res[(i, c)]):.3f}" for c in ctxs) + " |")


if __name__ == "__main__":
    main()
