"""Paged attention, our Triton kernel against FlashInfer (if installed), on the 31B's layer shapes.

Prefill chunks (causal, with and without a cached prefix) and the served mixed steps (chunks
beside decoding or verifying sequences) run through each backend's `forward`, exactly as the
model calls it, and decode batches through FlashInfer's decode wrapper for comparison
(the backend keeps decode on Triton). Eager launches, median of 20 after warm-up; `plan()` is host
time per step, reported apart. The roofline is max(bytes / copy bandwidth, FLOPs / the bf16
matmul rate the board holds).

For prompts with no cached prefix, torch's own attention kernels (`scaled_dot_product_attention`
with the flash and the cuDNN backends, GQA, scale 1) time the same attention over the prompt's
keys gathered into one contiguous tensor (the gather not timed): what a kernel reading a chunk's
own keys from a contiguous buffer would take.

  # The `flashinfer` extra; it JIT-builds its kernels on first use (needs nvcc).
  pip install flashinfer-python
  python bench/bench_attention_backends.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_offline import MATMUL_HOLD_S, measure_matmul_flops  # noqa: E402
from bench_step import copy_bandwidth, time_it  # noqa: E402

from gemma4serve.attention.flashinfer_backend import FlashInferAttention, paged_kv, plan  # noqa: E402
from gemma4serve.attention.metadata import HostBatch, causal_metadata  # noqa: E402
from gemma4serve.attention.triton_backend import TritonAttention  # noqa: E402
from gemma4serve.config import FULL, SLIDING  # noqa: E402

PAGE = {SLIDING: 16, FULL: 32}  # the 31B's served pages: one page's bytes in both kinds
LAYOUTS = {SLIDING: (32, 16, 256), FULL: (32, 4, 512)}  # the 31B: (q heads, kv heads, head_dim)
WINDOW = {SLIDING: 1024, FULL: 0}
# (sequences, new tokens, context) groups of one step
STEPS = [
    [(1, 1000, 1000)],
    [(2, 1024, 1024)],
    [(1, 2048, 6144)],
    [(8, 1, 1128)],
    [(32, 1, 1128)],
    # the served mixed steps at c = 32: verifications of k = 2 beside a prompt and the next one's
    # first chunk (MTP, 2048-token budget), or decodes beside a chunk (no MTP, 192-token budget)
    [(32, 3, 1100), (1, 1024, 1024), (1, 928, 928)],
    [(32, 1, 1100), (1, 160, 480)],
]


def median_us(fn, iters: int = 20) -> float:
    return time_it(fn, iters) * 1e6  # (bench_step's timer, in seconds)


def make_step(kind: str, groups: list[tuple[int, int, int]]):
    """One step of `groups` (sequences, new tokens, context): each sequence's new tokens end at
    position context - 1, the earlier keys cached."""
    nh, nkv, hd = LAYOUTS[kind]
    page = PAGE[kind]
    seqs = [(q_len, ctx) for count, q_len, ctx in groups for _ in range(count)]
    width = max(-(-ctx // page) for _, ctx in seqs)
    table = torch.zeros(len(seqs), width, dtype=torch.int32)
    used = 1  # page 0 is the null page
    for i, (_, ctx) in enumerate(seqs):
        pages = -(-ctx // page)
        table[i, :pages] = used + torch.arange(pages, dtype=torch.int32)
        used += pages
    k = torch.randn(used, page, nkv, hd, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    q_lens = torch.tensor([q_len for q_len, _ in seqs], dtype=torch.int32)
    q = torch.randn(int(q_lens.sum()), nh, hd, dtype=torch.bfloat16, device="cuda")
    pos = torch.cat([torch.arange(ctx - q_len, ctx) for q_len, ctx in seqs])
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    torch.cumsum(q_lens, 0, out=cu[1:])
    host = HostBatch(cu, torch.tensor([ctx for _, ctx in seqs], dtype=torch.int32), {kind: table})
    meta = causal_metadata(
        torch.arange(len(seqs), dtype=torch.int32).repeat_interleave(q_lens).cuda(),
        pos.cuda(),
        {kind: table.cuda()},
        WINDOW,
        cu.cuda(),
        int(q_lens.max()),
        {kind: page},
        host,
    )
    window = WINDOW[kind]
    visible = sum(min(p + 1, window or p + 1) for p in pos.tolist())
    keys = sum(min(ctx, window or ctx) for _, ctx in seqs)
    flops = 4 * nh * hd * visible
    bytes_ = 2 * (keys * nkv * hd * 2 + 2 * q.numel())
    return q, k, v, meta, flops, bytes_


def torch_sdpa_cells(q, k, v, meta, kind: str, groups: list, ref) -> str:
    """µs (relative difference to `ref`) of torch's flash and cuDNN attention over the prompts'
    keys made contiguous; '–' for chunks with a cached prefix or a window shorter than the chunk."""
    (seqs, q_len, ctx), *others = groups
    if others or q_len != ctx or (WINDOW[kind] and WINDOW[kind] < q_len):
        return "– | –"
    table = meta.page_table[kind].long()
    nh, _, hd = LAYOUTS[kind]

    def dense(cache):  # [seqs, nkv, q_len, hd]
        return cache[table].flatten(1, 2)[:, :q_len].transpose(1, 2).contiguous()

    kd, vd = dense(k), dense(v)
    qd = q.view(seqs, q_len, nh, hd).transpose(1, 2).contiguous()
    cells = []
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        try:
            with sdpa_kernel([backend]):
                run = lambda: F.scaled_dot_product_attention(  # noqa: E731
                    qd, kd, vd, is_causal=True, scale=1.0, enable_gqa=True
                )
                out = run().transpose(1, 2).reshape(q.shape)
                diff = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                cells.append(f"{median_us(run):.1f} ({diff:.0e})")
        except Exception as e:  # noqa: BLE001 (no kernel for this shape)
            cells.append(f"– ({type(e).__name__})")
    return " | ".join(cells)


def main() -> None:
    try:
        import flashinfer
    except ImportError:
        flashinfer = None
    print(
        f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"flashinfer {flashinfer.__version__ if flashinfer else 'not installed'}"
    )
    device = torch.device("cuda")
    bw, rate = copy_bandwidth(device), measure_matmul_flops(device, torch.bfloat16)
    held = f"held {MATMUL_HOLD_S:g} s"
    print(f"# copy bandwidth {bw / 1e12:.2f} TB/s, bf16 matmul {held} {rate / 1e12:.0f} TFLOP/s")
    triton_attn = TritonAttention()
    # every head dim FlashInfer builds, 512 included: what the served backend takes is chosen here
    flashinfer_attn = (
        FlashInferAttention(device, LAYOUTS, PAGE, head_dims=(256, 512)) if flashinfer else None
    )
    print(
        "\n| layer | sequences x new tokens @ context | roofline us | Triton us | FlashInfer us "
        "| plan() ms | rel diff | torch flash us (diff) | torch cuDNN us (diff) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for kind in (SLIDING, FULL):
        for groups in STEPS:
            q, k, v, meta, flops, bytes_ = make_step(kind, groups)
            roof = max(bytes_ / bw, flops / rate) * 1e6
            ref = triton_attn.forward(q, k, v, meta, kind)
            t_triton = median_us(lambda: triton_attn.forward(q, k, v, meta, kind))
            nh, nkv, hd = LAYOUTS[kind]
            try:
                if flashinfer is None:
                    raise RuntimeError("not installed")
                # FlashInfer's decode wrapper (the backend itself keeps decode on Triton).
                if meta.max_q_len == 1:
                    decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                        torch.empty(128 << 20, dtype=torch.uint8, device="cuda"),
                        "NHD",
                        use_tensor_cores=True,
                    )
                    t0 = time.perf_counter()
                    decode_wrapper.plan(
                        *paged_kv(meta.host, kind, PAGE[kind]),
                        nh,
                        nkv,
                        hd,
                        PAGE[kind],
                        window_left=WINDOW[kind] - 1 if WINDOW[kind] else -1,
                        sm_scale=1.0,
                        q_data_type=torch.bfloat16,
                        kv_data_type=torch.bfloat16,
                    )
                    plan_ms = (time.perf_counter() - t0) * 1e3
                    run = lambda: decode_wrapper.run(q, (k, v))  # noqa: E731
                elif kind in flashinfer_attn.wrappers:
                    t0 = time.perf_counter()
                    wrapper = flashinfer_attn.wrappers[kind]
                    plan(wrapper, meta, kind, nh, nkv, hd, PAGE[kind], torch.bfloat16)
                    plan_ms = (time.perf_counter() - t0) * 1e3
                    flashinfer_attn.planned[kind] = meta.host
                    run = lambda: flashinfer_attn.forward(q, k, v, meta, kind)  # noqa: E731
                else:
                    raise RuntimeError("no FlashInfer prefill kernel for this head_dim")
                out = run()
                diff = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                t_fi, cells = median_us(run), None
            except Exception as e:  # noqa: BLE001
                cells = f"– ({type(e).__name__}: {str(e).splitlines()[0][:60]})"
            fi_cols = f"{cells} | – | –" if cells else f"{t_fi:.1f} | {plan_ms:.2f} | {diff:.1e}"
            shape = " + ".join(f"{seqs} x {q_len} @ {ctx}" for seqs, q_len, ctx in groups)
            sdpa = torch_sdpa_cells(q, k, v, meta, kind, groups, ref)
            print(
                f"| {kind} hd{hd} | {shape} | {roof:.1f} | {t_triton:.1f} | {fi_cols} | {sdpa} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
