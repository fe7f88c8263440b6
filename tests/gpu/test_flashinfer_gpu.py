"""The FlashInfer backend, where the `flashinfer` extra is installed.

Its prefill path against the Triton kernel on a mixed eager step, and the steps it must leave to
Triton.
"""

from __future__ import annotations

import pytest
import torch

flashinfer = pytest.importorskip("flashinfer")

from gemma4serve.attention.flashinfer_backend import FlashInferAttention  # noqa: E402
from gemma4serve.attention.metadata import HostBatch, causal_metadata  # noqa: E402
from gemma4serve.attention.triton_backend import TritonAttention  # noqa: E402
from gemma4serve.config import FULL, SLIDING  # noqa: E402

PAGE = 16
LAYOUTS = {SLIDING: (8, 4, 256), FULL: (8, 2, 512)}  # the released head dims, fewer heads
WINDOW = {SLIDING: 100, FULL: 0}


@pytest.fixture(scope="module")
def backend():
    return FlashInferAttention(torch.device("cuda"), LAYOUTS, {kind: PAGE for kind in LAYOUTS})


def mixed_step(kind: str, free_old_pages: bool):
    """One eager step, page tables as the engine builds them, of three groups.

    A prefill chunk after a cached prefix (positions 60..139), a whole short prompt (0..31) and one
    decode row (position 150).
    """
    nh, nkv, hd = LAYOUTS[kind]
    g = torch.Generator("cuda").manual_seed(0)
    groups = [(60, 80), (0, 32), (150, 1)]  # (first position, new tokens)
    width = max(-(-(s + n) // PAGE) for s, n in groups)
    table = torch.zeros(len(groups), width, dtype=torch.int32)
    nxt = 1
    for i, (s, n) in enumerate(groups):
        for p in range(-(-(s + n) // PAGE)):
            table[i, p] = nxt
            nxt += 1
        if free_old_pages:  # sliding pages no query can see any more point at the null page 0
            first_visible = max(0, s - WINDOW[kind] + 1) // PAGE
            table[i, :first_visible] = 0
    k = torch.randn(nxt, PAGE, nkv, hd, generator=g, device="cuda").to(torch.bfloat16)
    v = torch.randn(nxt, PAGE, nkv, hd, generator=g, device="cuda").to(torch.bfloat16)
    k[0] = v[0] = 0  # the null page
    T = sum(n for _, n in groups)
    q = torch.randn(T, nh, hd, generator=g, device="cuda").to(torch.bfloat16)
    pos = torch.cat([torch.arange(s, s + n) for s, n in groups])
    token_seq = torch.cat(
        [torch.full((n,), i, dtype=torch.int32) for i, (_, n) in enumerate(groups)]
    )
    cu = torch.tensor(
        [0, *torch.tensor([n for _, n in groups]).cumsum(0).tolist()], dtype=torch.int32
    )
    host = HostBatch(cu, torch.tensor([s + n for s, n in groups], dtype=torch.int32), {kind: table})
    meta = causal_metadata(
        token_seq.cuda(),
        pos.cuda(),
        {kind: table.cuda()},
        WINDOW,
        cu.cuda(),
        max(n for _, n in groups),
        {kind: PAGE},
        host,
    )
    return q, k, v, meta


@pytest.mark.parametrize("kind", [SLIDING, FULL])
def test_prefill_matches_triton(backend, kind):
    q, k, v, meta = mixed_step(kind, free_old_pages=kind == SLIDING)
    ref = TritonAttention().forward(q, k, v, meta, kind)
    out = backend.forward(q, k, v, meta, kind)
    print(f"{kind}: served by {'FlashInfer' if kind in backend.wrappers else 'Triton'}")
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2
    # the plan is made once per step: a second layer of the same step reuses it
    assert torch.equal(backend.forward(q, k, v, meta, kind), out)


@pytest.mark.parametrize("kind", [SLIDING, FULL])
def test_steps_without_host_layout_stay_on_triton(backend, kind):
    """Steps without a host layout stay on Triton.

    Graph-captured and drafter steps carry no host layout; decode-only steps have one query per
    group.
    """
    q, k, v, meta = mixed_step(kind, free_old_pages=False)
    meta.host = None
    assert torch.equal(
        backend.forward(q, k, v, meta, kind), TritonAttention().forward(q, k, v, meta, kind)
    )


def test_sliding_head_dim_runs_on_flashinfer(backend):
    """The backend's reason to exist: the 31B's sliding layers (head_dim 256) take its prefill."""
    assert SLIDING in backend.wrappers


def test_the_backend_keeps_the_mixed_graphs(tiny_checkpoints):
    """Asked for by name, FlashInfer leaves every step that fits a graph to the graphs (prompt
    chunks beside decodes included) and the engine emits what it emits on Triton."""
    from gemma4serve import SamplingParams
    from tests.gpu.test_engine_gpu import gpu_llm

    def llm(backend: str):
        target = tiny_checkpoints.get("dense")
        return gpu_llm(target, attention_backend=backend, max_num_seqs=4, max_num_batched_tokens=64)

    prompts = [[2, *range(10, 10 + n)] for n in (90, 7, 40)]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    on_flashinfer, on_triton = llm("flashinfer"), llm("triton")
    assert on_flashinfer.engine.runner.state.attn.name == "flashinfer"
    assert on_flashinfer.engine.runner.graphs.mixed_tokens
    got = [o.outputs[0].token_ids for o in on_flashinfer.generate(prompts, sp)]
    assert got == [o.outputs[0].token_ids for o in on_triton.generate(prompts, sp)]
