"""The engine's captured decode / verify graphs (31B) under attention variants set through environment
variables read at launch time: EXP_PRELOAD (first K/V tile read before the PDL wait), EXP_DECODE_KEYS (keys per
sliding decode split)."""
import os
import sys
import torch

sys.path.insert(0, "bench")
from bench_step import fake_decoding_sequences, replay_target, time_it  # noqa
from gemma4serve.engine.args import EngineArgs  # noqa
from gemma4serve.engine.cuda_graphs import CudaGraphs  # noqa
from gemma4serve.engine.engine import LLMEngine  # noqa

VARIANTS = [dict(EXP_PRELOAD="0", EXP_DECODE_KEYS="64"), dict(EXP_PRELOAD="1", EXP_DECODE_KEYS="64"),
            dict(EXP_PRELOAD="1", EXP_DECODE_KEYS="32"), dict(EXP_PRELOAD="0", EXP_DECODE_KEYS="32")]
CASES = [(1, 0), (8, 0), (32, 0), (1, 4)]  # (batch, k)


def step_ms(engine, B, k, context=1128):
    chunks = fake_decoding_sequences(engine, B, context, k)
    graphs = CudaGraphs(engine.state, B, engine.max_model_len, k)
    graphs.buckets = [B]
    if k:
        graphs.q_lens = [k + 1]
    graphs.capture()
    t = time_it(lambda: replay_target(graphs, chunks), 60) * 1e3
    for ch in chunks:
        engine.kv.free(ch.seq.pages)
    graphs = None
    torch.cuda.empty_cache()
    return t


def main():
    engine = LLMEngine(EngineArgs(model=sys.argv[1] if len(sys.argv) > 1 else "configs/gemma-4-31B-it", draft="",
                                  load_format="dummy", device="cuda", dtype="bfloat16", max_num_seqs=32,
                                  num_draft_tokens=4, max_num_batched_tokens=200, max_model_len=1200,
                                  enforce_eager=True))
    print(torch.cuda.get_device_name(), sys.argv[1:])
    res = {}
    for rnd in range(2):
        for i, v in enumerate(VARIANTS):
            os.environ.update(v)
            for B, k in CASES:
                t = step_ms(engine, B, k)
                res.setdefault((i, B, k), []).append(t)
                print(f"round {rnd} {v} B={B} k={k}: {t:.3f} ms", flush=True)
    print("| variant | " + " | ".join(f"b{B} {'verify' if k else 'decode'}" for B, k in CASES) + " |")
    for i, v in enumerate(VARIANTS):
        print(f"| {v} | " + " | ".join(f"{min(res[(i, B, k)]):.3f}" for B, k in CASES) + " |")


if __name__ == "__main__":
    main()
