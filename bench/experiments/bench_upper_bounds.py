"""How much each small kernel of the batch-1 decode step costs in place: the engine's captured decode graph with
kernels dropped (wrong numbers, right timing), so each row is an upper bound on what fusing that kernel away can
save."""
import sys
import torch

sys.path.insert(0, "bench")
import gemma4serve_kernels as K  # noqa
import gemma4serve.attention.triton_backend as TB  # noqa
from bench_step import fake_decoding_sequences, replay_target, time_it  # noqa
from gemma4serve.engine.args import EngineArgs  # noqa
from gemma4serve.engine.cuda_graphs import CudaGraphs  # noqa
from gemma4serve.engine.engine import LLMEngine  # noqa

PA = sys.modules["gemma4serve_kernels.paged_attention"]
orig = dict(res=K.rmsnorm_residual_add, epi=K.qkv_epilogue, attn=TB.paged_attention, merge=PA._merge_kernel)


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *a, **k: None


def no_res(x, h, w, eps, scalar=None, next_w=None):
    return h if next_w is None else (h, h)


def no_epi(qkv, qw, kw, cos, sin, eps, kc, vc, slots, nh, nkv, k_eq_v):
    return qkv[:, : nh * kc.shape[-1]].view(qkv.shape[0], nh, kc.shape[-1])


PATCH = dict(res=no_res, epi=no_epi, attn=lambda q, *a, **k: q, merge=_NoLaunch())


def apply(drop):
    K.rmsnorm_residual_add = PATCH["res"] if "res" in drop else orig["res"]
    K.qkv_epilogue = PATCH["epi"] if "epi" in drop else orig["epi"]
    TB.paged_attention = PATCH["attn"] if "attn" in drop else orig["attn"]
    PA._merge_kernel = PATCH["merge"] if "merge" in drop else orig["merge"]


def main():
    engine = LLMEngine(EngineArgs(model="configs/gemma-4-31B-it", draft="", load_format="dummy", device="cuda",
                                  dtype="bfloat16", max_num_seqs=1, max_num_batched_tokens=64, max_model_len=1200,
                                  enforce_eager=True))
    s = engine.state
    print(torch.cuda.get_device_name())
    variants = [(), ("res",), ("epi",), ("merge",), ("epi", "merge"), ("epi", "attn", "merge"),
                ("res", "epi", "merge"), ("res", "epi", "attn", "merge")]
    results = {v: [] for v in variants}
    for rnd in range(2):
        for v in variants:
            apply(v)
            chunks = fake_decoding_sequences(engine, 1, 1128, 0)
            graphs = CudaGraphs(s, 1, engine.max_model_len, 0)
            graphs.buckets = [1]
            graphs.capture()
            results[v].append(time_it(lambda: replay_target(graphs, chunks), 100) * 1e3)
            for ch in chunks:
                engine.kv.free(ch.seq.pages)
            graphs = None
            torch.cuda.empty_cache()
            print(f"round {rnd} drop {'+'.join(v) or 'nothing':22s} {results[v][-1]:.3f} ms", flush=True)
    apply(())
    base = min(results[()])
    print("| dropped | step ms (best of 2) | saved ms |")
    print("|---|---|---|")
    for v, ts in results.items():
        print(f"| {'+'.join(v) or 'nothing'} | {min(ts):.3f} | {base - min(ts):.3f} |")


if __name__ == "__main__":
    main()
