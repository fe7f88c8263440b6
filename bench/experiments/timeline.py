"""Where the batch-1 decode step's time goes, kernel by kernel, with overlap accounted for: the captured decode
graph replayed under the CUDA profiler; every kernel is charged the time between the previous kernel's end and
its own end (the sum is the step). Printed per kernel role, plus one sliding and one full layer in full."""
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, "bench")
from bench_step import fake_decoding_sequences, replay_target  # noqa
from gemma4serve.engine.args import EngineArgs  # noqa
from gemma4serve.engine.cuda_graphs import CudaGraphs  # noqa
from gemma4serve.engine.engine import LLMEngine  # noqa

def short(name):
    for k in ("_gemv_streamk_kernel", "_gemv_kernel", "_qkv_epilogue_kernel", "_attn_kernel", "_merge_kernel",
              "_residual_norm_kernel", "_rms_norm_kernel"):
        if k in name:
            return k
    return name[:50]


def main():
    B = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    engine = LLMEngine(EngineArgs(model="configs/gemma-4-31B-it", draft="", load_format="dummy", device="cuda",
                                  dtype="bfloat16", max_num_seqs=B, max_num_batched_tokens=64, max_model_len=1200,
                                  enforce_eager=True))
    chunks = fake_decoding_sequences(engine, B, 1128, 0)
    graphs = CudaGraphs(engine.state, B, engine.max_model_len, 0)
    graphs.buckets = [B]
    graphs.capture()
    for _ in range(5):
        replay_target(graphs, chunks)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            replay_target(graphs, chunks)
        torch.cuda.synchronize()
    ev = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                 and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()),
                key=lambda e: e.time_range.start)
    # one replay: the kernels between the 2nd and 3rd embedding gathers (first kernel of a step)
    n = len(ev) // 3
    step = ev[n:2 * n]
    t0 = step[0].time_range.start
    charged = defaultdict(float)
    count = defaultdict(int)
    rows = []
    prev_end = step[0].time_range.start
    layer_pos = 0
    roles = []
    gemvs = [i for i, e in enumerate(step) if short(e.name).startswith("_gemv")]
    for i, e in enumerate(step):
        s = short(e.name)
        if i == gemvs[-1]:
            role = "lm_head"
        elif s == "_gemv_kernel" or s == "_gemv_streamk_kernel":
            role = ["qkv", "o_proj", "gate_up", "down"][min(layer_pos, 3)] if layer_pos < 4 else "gemv?"
            layer_pos += 1
        elif s == "_residual_norm_kernel":
            role = "res_norm"
            if layer_pos >= 4:
                layer_pos = 0
        else:
            role = s
        roles.append(role)
        c = e.time_range.end - prev_end
        charged[role] += c
        count[role] += 1
        rows.append((role, s, e.time_range.start - t0, e.time_range.end - t0, e.time_range.end - e.time_range.start, c))
        prev_end = max(prev_end, e.time_range.end)
    total = step[-1].time_range.end - step[0].time_range.start
    print(torch.cuda.get_device_name(), f"batch {B}: {len(step)} kernels, {total:.1f} us first start -> last end")
    print("| role | kernels | charged us | per kernel us |")
    print("|---|---|---|---|")
    for r, v in sorted(charged.items(), key=lambda kv: -kv[1]):
        print(f"| {r} | {count[r]} | {v:.1f} | {v / count[r]:.2f} |")
    print("\nthe step's first 14 and last 16 kernels, and one full layer (start, end; duration; charged):")
    for r in rows[:14] + rows[-16:] + rows[43:55]:
        print(f"{r[0]:22s} {r[1]:24s} start {r[2]:9.2f} end {r[3]:9.2f} dur {r[4]:7.2f} charged {r[5]:7.2f}")


if __name__ == "__main__":
    main()
