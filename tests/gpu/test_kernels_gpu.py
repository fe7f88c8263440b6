"""The Triton kernels on CUDA at the real Gemma 4 shapes in bf16, and CUDA-graph capture of a step.

31B attention: 32 query heads; sliding layers hd 256 / 16 KV heads / W 1024, full layers hd 512 /
4 KV heads. 26B-A4B MoE: 128 experts, top-8, H 2816, expert width 704. References: the torch
attention backend in fp32 on the same bf16 inputs (the kernel keeps scores in fp32, so it is closer
to that than the bf16 eager path), and gemma4serve/model/layers.py run on CPU for the rest (on
CUDA, layers.py dispatches to these very kernels).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

if (
    not torch.cuda.is_available()
):  # before importing any kernel: without CUDA the CPU tests run interpreted
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1])
)  # the paged-layout builder of the CPU tests
from test_triton_kernels import (  # noqa: E402
    KIND,
    _assert_rounding_close,
    _gelu_mul_ref,
    _norm_rope_ref,
    _residual_ref,
    build_paged_batch,
    on_cpu,
    reference_attention,
)

from gemma4serve.attention.torch_backend import write_kv  # noqa: E402
from gemma4serve.attention.triton_backend import TritonAttention  # noqa: E402
from gemma4serve.config import RopeSpec  # noqa: E402
from gemma4serve.model.layers import Experts, rms_norm, rope_cos_sin, rope_inv_freq  # noqa: E402
from gemma4serve_kernels import (  # noqa: E402
    LONG_PREFIX,
    attention_config,
    gelu_tanh_mul,
    gelu_tanh_times,
    gemv,
    gemv_mlp,
    greedy_head,
    kv_write,
    moe_experts,
    moe_route,
    rmsnorm_residual_add,
    rmsnorm_rope,
    rope_tables,
    write_slots,
)
from gemma4serve_kernels import rms_norm as k_rms_norm  # noqa: E402
from gemma4serve_kernels.gemv import _zeroed_scratch, mlp_down_config  # noqa: E402

DEV = torch.device("cuda")
BF16 = torch.bfloat16
SHAPES = {
    "sliding": dict(nh=32, nkv=16, hd=256, window=1024),
    "full": dict(nh=32, nkv=4, hd=512, window=0),
}


def _contexts(B, seed, lo=1000, hi=4000):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi, (B,), generator=generator).tolist()


def _seqs(phase, B, seed=0):
    if phase == "decode":
        return [(L, [L]) for L in _contexts(B, seed)]
    if phase == "verify":  # last token + 4 drafts
        return [(L, list(range(L - 4, L + 1))) for L in _contexts(B, seed)]
    if phase == "mixed":
        return [
            (2128, list(range(2001, 2129))),  # 128-token prefill chunk starting at position 2000
            (3000, [3000]),  # decode
            (1500, list(range(1496, 1501))),  # verify
            (2600, [2590]),  # drafter-style: committed length 2590, stale rows beyond
            (200, list(range(1, 201))),  # a prompt's first chunk
        ]
    if phase == "wide":  # a step of 2052 rows: the prefill launch's 128-row tiles
        return [
            (3000, [3000]),  # decode
            (1500, list(range(1498, 1501))),  # verify
            (3072, list(range(1025, 3073))),  # 2048-token chunk after 1024 cached positions
        ]
    if phase == "long":  # 1025 rows, too few programs alone: the full layers' tiles by context
        return [
            (3000, [3000]),  # decode
            (LONG_PREFIX, list(range(LONG_PREFIX - 1023, LONG_PREFIX + 1))),
        ]
    raise ValueError(phase)


def _batch(shape, seqs, window=None, seed=0):
    s = SHAPES[shape]
    q, kc, vc, meta = build_paged_batch(
        seqs,
        nh=s["nh"],
        nkv=s["nkv"],
        hd=s["hd"],
        page_size=16,
        window=s["window"] if window is None else window,
        dtype=BF16,
        device=DEV,
        seed=seed,
    )
    # Raw randn scores have std sqrt(hd): the softmax would be nearly one-hot. Soften it so the
    # test checks a real weighted sum.
    q = (q.float() * s["hd"] ** -0.5 * 2).to(BF16)
    return q, kc, vc, meta


def _reference(q, kc, vc, meta, rows=128):
    """The torch backend in fp32, `rows` query rows at a time.

    Its per-token gather would need tens of GB for a whole batch at these shapes.
    """
    q, kc, vc = q.float(), kc.float(), vc.float()
    out = torch.empty_like(q)
    for r0 in range(0, q.shape[0], rows):
        r1 = min(r0 + rows, q.shape[0])
        sub = dataclasses.replace(
            meta,
            token_seq=meta.token_seq[r0:r1],
            kv_end=meta.kv_end[r0:r1],
            cu_seqlens_q=torch.tensor([0, r1 - r0], dtype=torch.int32, device=DEV),
            max_q_len=r1 - r0,
        )
        out[r0:r1] = reference_attention(q[r0:r1], kc, vc, sub)
    return out


def _check_attention(out, q, kc, vc, meta, rows=128):
    ref = _reference(q, kc, vc, meta, rows)
    assert out.dtype == BF16 and not torch.isnan(out).any()
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    assert (out.float() - ref).abs().mean().item() < 2e-3


@pytest.mark.parametrize("shape", ["sliding", "full"])
@pytest.mark.parametrize(
    "phase,B",
    [
        ("decode", 1),
        ("decode", 8),
        ("decode", 32),
        ("verify", 1),
        ("verify", 8),
        ("verify", 32),
        ("mixed", 5),
        ("wide", 3),
        ("long", 2),
    ],
)
def test_attention_real_shapes(shape, phase, B):
    q, kc, vc, meta = _batch(shape, _seqs(phase, B))
    if phase == "long":  # a 1024-token chunk reaching 8192 positions
        meta = dataclasses.replace(meta, chunk_context=LONG_PREFIX)
    if phase in ("wide", "long"):  # the step takes the 128-row prefill tiles
        s = SHAPES[shape]
        tiles = attention_config(
            s["hd"], s["nh"] // s["nkv"], meta.max_q_len, q.shape[0], s["nkv"], meta.chunk_context
        )
        assert tiles["block_m"] == 128
    out = TritonAttention().forward(q, kc, vc, meta, KIND)
    # The fp32 reference gathers every row's keys: fewer rows at a time over the long prefix.
    _check_attention(out, q, kc, vc, meta, rows=32 if phase == "long" else 128)


@pytest.mark.parametrize("shape", ["sliding", "full"])
def test_attention_drafter_real_shapes(shape):
    """Drafter reads: one row per sequence at kv_end = P; sliding window W_a + 1 = 1025."""
    window = 1025 if shape == "sliding" else 0
    seqs = [(L + 3, [L]) for L in _contexts(8, seed=5)]
    q, kc, vc, meta = _batch(shape, seqs, window=window)
    _check_attention(TritonAttention().forward(q, kc, vc, meta, KIND), q, kc, vc, meta)


def test_kv_write_real_shapes():
    kc = torch.randn(64, 16, 16, 256, device=DEV).to(BF16)
    vc = torch.randn_like(kc)
    k = torch.randn(40, 16, 256, device=DEV).to(BF16)
    v = torch.randn_like(k)
    slots = torch.randperm(64 * 16, device=DEV)[:40]
    slots[::7] = -1
    kr, vr = kc.clone(), vc.clone()
    keep = slots >= 0
    write_kv(kr, vr, k[keep], v[keep], slots[keep])
    kv_write(kc, vc, k, v, slots)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)


def _last_slots(meta, page_size, kv_end):
    """Physical slot of position kv_end - 1 of each decode row (host-side, test only)."""
    table = meta.page_table[KIND].cpu()
    rows = meta.token_seq.cpu()
    pos = kv_end.cpu().long() - 1
    pages = table[rows, pos // page_size].long()
    return (pages * page_size + pos % page_size).to(DEV)


@pytest.mark.parametrize("shape", ["sliding", "full"])
@pytest.mark.parametrize("q_len", [1, 5])
def test_decode_step_cuda_graph(shape, q_len):
    """A captured write + attention step, replayed on new inputs, equals eager.

    The step is a batch-8 decode (q_len 1) or verify (5). Before each replay the slots the step
    writes hold NaN: attention starts reading K/V before its producer (the write) finishes, so it
    must read this step's own keys again after waiting.
    """
    backend = TritonAttention()
    # The pool holds 800 positions past each row, so later steps can move kv_end forward in place
    # (moving it back would put the sliding window on pages the builder freed).
    q, kc, vc, meta = _batch(
        shape, [(L + 800, list(range(L - q_len + 1, L + 1))) for L in _contexts(8, seed=2)]
    )
    T, nkv, hd = q.shape[0], kc.shape[2], kc.shape[3]
    k_new = torch.randn(T, nkv, hd, device=DEV).to(BF16)
    v_new = torch.randn_like(k_new)
    slots = _last_slots(meta, 16, meta.kv_end)

    def step():
        backend.write(kc, vc, k_new, v_new, slots)
        return backend.forward(q, kc, vc, meta, KIND)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()

    for advance in (0, 1, 700):  # the same graph over new tokens and longer views
        q.copy_((torch.randn_like(q, dtype=torch.float32) * hd**-0.5 * 2).to(BF16))
        k_new.copy_(torch.randn_like(k_new, dtype=torch.float32).to(BF16))
        v_new.copy_(torch.randn_like(v_new, dtype=torch.float32).to(BF16))
        meta.kv_end.add_(advance)
        slots.copy_(_last_slots(meta, 16, meta.kv_end))
        kc_ref, vc_ref = kc.clone(), vc.clone()
        kv_write(kc_ref, vc_ref, k_new, v_new, slots)
        eager = backend.forward(q, kc_ref, vc_ref, meta, KIND)
        kc.view(-1, nkv, hd)[slots] = float("nan")
        vc.view(-1, nkv, hd)[slots] = float("nan")
        graph.replay()
        torch.cuda.synchronize()
        # page 0 is the NaN-filled null page (NaN != NaN): it must stay untouched, the rest equal
        assert torch.equal(kc[1:], kc_ref[1:]) and torch.equal(vc[1:], vc_ref[1:])
        assert kc[0].isnan().all() and vc[0].isnan().all()
        assert torch.equal(static_out, eager)
        _check_attention(static_out, q, kc, vc, meta)


# -------------------------------------------------------------------------------------- norms / act
def test_norms_real_shapes():
    generator = torch.Generator(DEV).manual_seed(0)
    H = 5376
    x = torch.randn(32, H, generator=generator, device=DEV).to(BF16)
    h = (torch.randn(32, H, generator=generator, device=DEV) * 5).to(BF16)
    w = (torch.rand(H, generator=generator, device=DEV) * 2).to(BF16)
    scalar = torch.tensor([0.6], device=DEV, dtype=BF16)
    _assert_rounding_close(k_rms_norm(h, w, 1e-6), on_cpu(rms_norm, h, w, 1e-6))
    _assert_rounding_close(k_rms_norm(h, None, 1e-6), on_cpu(rms_norm, h, None, 1e-6))
    _assert_rounding_close(
        rmsnorm_residual_add(x, h, w, 1e-6), on_cpu(_residual_ref, x, h, w, None)
    )
    _assert_rounding_close(
        rmsnorm_residual_add(x, h, w, 1e-6, scalar), on_cpu(_residual_ref, x, h, w, scalar)
    )


@pytest.mark.parametrize(
    "heads,hd,theta,pairs", [(32, 256, 1e4, 128), (32, 512, 1e6, 64), (16, 256, 1e4, 128)]
)
def test_rmsnorm_rope_real_shapes(heads, hd, theta, pairs):
    generator = torch.Generator(DEV).manual_seed(1)
    T = 40
    x = (torch.randn(T, heads, hd, generator=generator, device=DEV) * 3).to(BF16)
    w = (torch.rand(hd, generator=generator, device=DEV) * 2).to(BF16)
    pos = torch.randint(0, 100000, (T,), generator=generator, device=DEV)
    cos, sin = rope_cos_sin(
        rope_inv_freq(RopeSpec(theta=theta, head_dim=hd, rotated_pairs=pairs)).to(DEV), pos, BF16
    )
    _assert_rounding_close(
        rmsnorm_rope(x, w, cos, sin, 1e-6), on_cpu(_norm_rope_ref, x, w, cos, sin)
    )


def test_gelu_tanh_mul_real_shape():
    gu = (torch.randn(32, 2 * 21504, device=DEV) * 3).to(BF16)
    _assert_rounding_close(gelu_tanh_mul(gu), on_cpu(_gelu_mul_ref, gu))


# -------------------------------------------------------------------------------------- skinny GEMM
@pytest.mark.parametrize("M", [1, 5, 16])
@pytest.mark.parametrize(
    "N,K",
    [
        (16384, 5376),
        (5376, 8192),
        (5376, 16384),
        (43008, 5376),
        (5376, 21504),
        (262144, 1024),
        (1024, 10752),
    ],
)
def test_gemv_real_shapes(M, N, K):
    """The 31B's projections, its drafter's LM head and split-K input projection.

    At decode / verify / tile rows.
    """
    generator = torch.Generator(DEV).manual_seed(M)
    x = torch.randn(M, K, generator=generator, device=DEV).to(BF16)
    w = (torch.randn(N, K, generator=generator, device=DEV) * 0.02).to(BF16)
    ref = x.float() @ w.float().T
    y = gemv(x, w)
    assert ((y.float() - ref).norm() / ref.norm()).item() < 5e-3  # bf16 output rounding only
    assert torch.equal(y, gemv(x, w))  # deterministic, split-K included


@pytest.mark.parametrize("M", [1, 5, 16])
@pytest.mark.parametrize("inter,H", [(21504, 5376), (8192, 1024), (6144, 1536)])
def test_gemv_glu_epilogue_equals_activation_kernel(M, inter, H):
    """The gate_up GEMV's GELU·up epilogue = gemv then the activation kernel, bit for bit.

    At the shapes of the 31B, its drafter and the E2B.
    """
    generator = torch.Generator(DEV).manual_seed(M)
    x = torch.randn(M, H, generator=generator, device=DEV).to(BF16)
    w = (torch.randn(2 * inter, H, generator=generator, device=DEV) * 0.05).to(BF16)
    assert torch.equal(gemv(x, w, glu=True), gelu_tanh_mul(gemv(x, w)))


@pytest.mark.parametrize("M", [1, 5, 16])
@pytest.mark.parametrize("N,K", [(256, 2560), (256, 1536)])
def test_gemv_gelu_times_equals_activation_kernel(M, N, K):
    """PLE's gate GEMV (E4B, E2B shapes, split along K) with its GELU·times epilogue = gemv then
    the activation kernel, bit for bit; the per-layer input a strided slice as in the model."""
    generator = torch.Generator(DEV).manual_seed(M)
    x = torch.randn(M, K, generator=generator, device=DEV).to(BF16)
    w = (torch.randn(N, K, generator=generator, device=DEV) * 0.05).to(BF16)
    times = torch.randn(M, 42, N, generator=generator, device=DEV).to(BF16)[:, 7]
    want = gelu_tanh_times(gemv(x, w), times)
    assert torch.equal(gemv(x, w, gelu_times=times), want)
    ref = torch.nn.functional.gelu(x.float() @ w.float().T, approximate="tanh") * times.float()
    assert ((want.float() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.parametrize("M", [1, 5, 16])
@pytest.mark.parametrize("inter,H", [(21504, 5376), (10752, 5376), (8192, 1024), (6144, 1536)])
def test_gemv_mlp_equals_two_gemvs(M, inter, H):
    """gemv_mlp = the GLU GEMV then down with the same K splits, bit for bit, launch after launch.

    In gemv_mlp down awaits gate_up's flags under PDL. At the shapes of the 31B (on one GPU and on
    a rank of two), its drafter and the E2B; the narrow two chained with an explicit down tile.
    """
    generator = torch.Generator(DEV).manual_seed(M)
    x = torch.randn(M, H, generator=generator, device=DEV).to(BF16)
    gate_up = (torch.randn(2 * inter, H, generator=generator, device=DEV) * 0.05).to(BF16)
    down = (torch.randn(H, inter, generator=generator, device=DEV) * 0.02).to(BF16)
    cfg = mlp_down_config(H, inter, DEV) or (32, 256, 4, 4, 12)
    two = gemv(gemv(x, gate_up, glu=True), down, config=cfg)
    for _ in range(5):
        assert torch.equal(gemv_mlp(x, gate_up, down, config=cfg), two)
        assert not _zeroed_scratch(DEV)[1].any()  # the flags are re-armed for the next launch


@pytest.mark.parametrize("K", [5376, 1536])
def test_greedy_head_real_shapes(K):
    """The greedy head = the first argmax of softcap(gemv) at the 31B's and E2B's head shapes.

    262,144 tokens, 64 rows in chunks of 1 / 5 / 16, over random, peaked (x along a token's row, so
    the winner stands out) and saturated logits (many tokens tie at the cap), with graph replay of
    the whole head.
    """
    from gemma4serve_kernels import quantize_rows, value_table

    generator = torch.Generator(DEV).manual_seed(K)
    w = (torch.randn(262144, K, generator=generator, device=DEV) * 0.02).to(BF16)
    q, scale = quantize_rows(w)
    softcap = lambda v: torch.tanh(v / 30.0) * 30.0  # noqa: E731
    table = value_table(softcap, DEV)
    x = torch.randn(64, K, generator=generator, device=DEV)
    peaked = torch.randint(0, 262144, (16,), generator=generator, device=DEV)
    x[16:32] += 3 * w[peaked].float() / 0.02
    x[32:48] *= 40
    x = x.to(BF16)
    for M in (1, 5, 16):
        for i in range(0, 64 - M + 1, M):
            rows = x[i : i + M]
            tokens, values = greedy_head(rows, w, q, scale, table)
            logits = softcap(gemv(rows, w))
            assert torch.equal(tokens, logits.argmax(-1)), (M, i)
            assert torch.equal(values, logits.max(-1).values.float()), (M, i)
    rows = x[:5].clone()
    greedy_head(rows, w, q, scale, table)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = greedy_head(rows, w, q, scale, table)
    for i in range(0, 60, 5):
        rows.copy_(x[i : i + 5])
        graph.replay()
        assert torch.equal(out, softcap(gemv(rows, w)).argmax(-1)), i


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_step_inputs_equal_torch_ops(dtype):
    """The RoPE tables and write slots of one launch each equal the torch ops they replace.

    Bit for bit, at the 31B's sliding and proportional full specs: the same fp32 angles, libdevice
    cos/sin as torch's CUDA kernels.
    """
    pos = torch.arange(0, 262144, 7, device=DEV)
    for spec in (RopeSpec(1e4, 256, 128), RopeSpec(1e6, 512, 64)):
        inv = rope_inv_freq(spec).to(DEV)
        emb = pos.float()[:, None] * inv[None, :]
        emb = torch.cat([emb, emb], dim=-1)
        cos, sin = rope_tables(inv, pos, dtype)
        assert torch.equal(cos, emb.cos().to(dtype)) and torch.equal(sin, emb.sin().to(dtype))
    generator = torch.Generator(DEV).manual_seed(3)
    tables = {
        k: torch.randint(0, 5000, (9, 300), generator=generator, device=DEV, dtype=torch.int32)
        for k in ("a", "b")
    }
    token_seq = torch.randint(0, 9, (64,), generator=generator, device=DEV, dtype=torch.int32)
    p = torch.randint(0, 300 * 16, (64,), generator=generator, device=DEV)
    page_tokens = {"a": 16, "b": 40}
    kv_end, slots = write_slots(token_seq, p // 3, tables, page_tokens)
    assert torch.equal(kv_end, (p // 3 + 1).to(torch.int32))
    for k, t in tables.items():
        n = page_tokens[k]
        assert torch.equal(slots[k], t[token_seq.long(), p // 3 // n].long() * n + p // 3 % n)


@pytest.mark.parametrize("dataflow_mlp", [False, True])
def test_pdl_chain_graph_replay_is_stable(dataflow_mlp):
    """A decode-like chain of PDL kernels in one CUDA graph replays bit for bit.

    Each kernel may launch while its producer drains; with `dataflow_mlp` down also starts before
    gate_up has ended, on flags. Every replay equals the eager run bit for bit, and the eager run
    matches the torch reference. A missing wait would show up as replays that differ from each
    other or from the reference.
    """
    generator = torch.Generator(DEV).manual_seed(7)
    H, inter = 5376, 21504
    w_in = (torch.randn(2 * inter, H, generator=generator, device=DEV) * 0.02).to(BF16)
    w_out = (torch.randn(H, inter, generator=generator, device=DEV) * 0.02).to(BF16)
    norm_w = (torch.rand(H, generator=generator, device=DEV) * 2).to(BF16)
    x = torch.randn(1, H, generator=generator, device=DEV).to(BF16)

    def chain():
        h, normed = x, None
        for _ in range(8):
            normed = normed if normed is not None else k_rms_norm(h, norm_w, 1e-6)
            mlp = (
                gemv_mlp(normed, w_in, w_out)
                if dataflow_mlp
                else gemv(gelu_tanh_mul(gemv(normed, w_in)), w_out)
            )
            h, normed = rmsnorm_residual_add(h, mlp, norm_w, 1e-6, next_weight=norm_w)
        return h

    def reference():
        h, normed = x.float(), None
        for _ in range(8):
            normed = rms_norm(h.to(BF16), norm_w, 1e-6).float() if normed is None else normed
            gu = (normed.to(BF16).float() @ w_in.float().T).to(BF16)
            d = (_gelu_mul_ref(gu).float() @ w_out.float().T).to(BF16)
            h = _residual_ref(h.to(BF16), d, norm_w, None)
            normed = rms_norm(h, norm_w, 1e-6).float()
        return h

    eager = chain()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
    for _ in range(20):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
    ref = reference()
    assert ((eager.float() - ref.float()).norm() / ref.float().norm()).item() < 2e-2


# ------------------------------------------------------------------------------------ MoE (26B-A4B)
E, TOP_K, H_MOE, I_MOE = 128, 8, 2816, 704


@pytest.fixture(scope="module")
def experts():
    """The reference module (on CPU) and its weights on the GPU."""
    cfg = SimpleNamespace(
        num_experts=E, top_k_experts=TOP_K, hidden_size=H_MOE, moe_intermediate_size=I_MOE
    )
    mod = Experts(cfg)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        mod.gate_up_proj.copy_(
            torch.randn(mod.gate_up_proj.shape, generator=generator) * H_MOE**-0.5
        )
        mod.down_proj.copy_(torch.randn(mod.down_proj.shape, generator=generator) * I_MOE**-0.5)
    mod = mod.to(BF16)
    return mod, mod.gate_up_proj.detach().to(DEV), mod.down_proj.detach().to(DEV)


def test_moe_route_real_shape():
    generator = torch.Generator(DEV).manual_seed(4)
    logits = (
        torch.randn(257, E, generator=generator, device=DEV) * 3
    )  # fp32: no exact ties, so the top-k is unique
    scale = torch.rand(E, generator=generator, device=DEV) + 0.5
    w, ids = moe_route(logits, scale, TOP_K)
    probs = torch.softmax(logits, -1, dtype=torch.float32)
    ref_w, ref_i = torch.topk(probs, TOP_K, dim=-1)
    ref_w = ref_w / ref_w.sum(-1, keepdim=True) * scale[ref_i]
    assert torch.equal(ids.long(), ref_i)
    torch.testing.assert_close(w, ref_w, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("T", [1, 32, 257])
def test_moe_experts_real_shapes(experts, T):
    generator = torch.Generator(DEV).manual_seed(T)
    x = torch.randn(T, H_MOE, generator=generator, device=DEV).to(BF16)
    weights, ids = moe_route(
        torch.randn(T, E, generator=generator, device=DEV),
        torch.rand(E, generator=generator, device=DEV) + 0.5,
        TOP_K,
    )
    ref_mod, gate_up, down = experts
    ref = on_cpu(ref_mod, x, weights, ids.long())
    out = moe_experts(x, gate_up, down, weights, ids)
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)
    assert (out.float() - ref.float()).abs().mean().item() < 3e-3
