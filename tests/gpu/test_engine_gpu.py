"""The parity, MTP and CUDA-graph suites on a GPU in bf16: our kernels and graphs against HF 5.17.

bf16 results of different (correct) kernels differ in the last bits, and bf16 logits above 16 are
spaced 0.125 apart, so greedy paths may part at a near-tie (docs/gemma4.md §3.7, §9.2). Where two
greedy runs differ, the test asserts that the first difference is such a tie under an fp32 oracle,
and compares nothing after it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import pytest
import torch

from gemma4serve import LLM, SamplingParams
from gemma4serve.engine import cuda_graphs
from gemma4serve.structured.spec import StructuredOutputsParams
from tests.hf_oracle import hf_logits, load_hf_target
from tests.test_model_parity import engine_logits, prompt_of, rel_err

VARIANTS = ["dense", "moe", "ple"]


@pytest.fixture(scope="module", params=VARIANTS)
def ckpt(request, tiny_checkpoints):
    variant = request.param
    return variant, tiny_checkpoints.get(variant), tiny_checkpoints.get_assistant(variant)


def gpu_llm(target, draft=None, **kw) -> LLM:
    settings = dict(max_num_seqs=8, max_num_batched_tokens=512, kv_cache_memory=256 * 2**20) | kw
    return LLM(
        str(target),
        draft=str(draft) if draft else None,
        device="cuda",
        dtype="bfloat16",
        **settings,
    )


def assert_same_or_near_tie(
    got: list[int], want: list[int], prompt: list[int], judge, noisy
) -> None:
    """Assert equal runs, or runs parting where the two tokens tie within bf16's own noise.

    A tie: their fp32-oracle logit gap is smaller than twice the largest difference between HF's
    bf16 logits (`noisy`) and the oracle there.
    """
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            ctx = prompt + want[:i]
            exact = hf_logits(judge, ctx)[-1]
            noise = (hf_logits(noisy, ctx)[-1] - exact).abs().max().item()
            gap = (exact[a] - exact[b]).abs().item()
            assert gap < 2 * noise, (
                f"position {i}: {a} vs {b}, fp32 gap {gap:.3f} >= 2 x bf16 noise {noise:.3f}"
            )
            return
    assert len(got) == len(want)


def test_bf16_logits_match_hf(ckpt):
    """Our bf16 logits are as close to the fp32 oracle as HF's own bf16 run is.

    HF runs eager or sdpa, whichever is closer: the kernels add no error beyond bf16's.
    """
    variant, target, _ = ckpt
    llm = gpu_llm(target, enforce_eager=True)
    prompt = prompt_of(3 * llm.engine.cfg.sliding_window + 5, seed=1)
    ref = hf_logits(load_hf_target(target, dtype=torch.float32, device="cuda"), prompt)
    hf_err = min(
        rel_err(
            hf_logits(
                load_hf_target(target, dtype=torch.bfloat16, device="cuda", attn=attn), prompt
            ),
            ref,
        )
        for attn in ("eager", "sdpa")
    )
    whole = engine_logits(llm, prompt, chunk=len(prompt))
    chunked = engine_logits(llm, prompt, chunk=llm.engine.cfg.sliding_window - 3)
    print(
        f"{variant}: rel err vs fp32 oracle: ours {rel_err(whole, ref):.4f} / "
        f"chunked {rel_err(chunked, ref):.4f}, HF bf16 {hf_err:.4f}"
    )
    assert rel_err(whole, ref) <= max(2 * hf_err, 1e-2)
    assert rel_err(chunked, ref) <= max(2 * hf_err, 1e-2)


def test_bf16_greedy_matches_hf(ckpt):
    variant, target, _ = ckpt
    llm = gpu_llm(target)
    judge = load_hf_target(target, dtype=torch.float32, device="cuda")
    hf = load_hf_target(target, dtype=torch.bfloat16, device="cuda")
    from tests.hf_oracle import hf_greedy

    for n in (5, 40):
        prompt = prompt_of(n, seed=n)
        got = llm.generate(
            [prompt], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
        )[0].token_ids
        assert_same_or_near_tie(got, hf_greedy(hf, prompt, 32), prompt, judge, hf)


@pytest.mark.parametrize("batch", [1, 4])
def test_cuda_graph_replay_equals_eager(ckpt, batch):
    """Token for token.

    The adaptive draft length is off in both: it sets k from the graphs' measured replay times
    (eager keeps k fixed), so with it the two would run different verify steps, whose bf16 results
    agree only up to near-ties (test_mtp_greedy_equals_plain_bf16 covers that).
    """
    variant, target, assistant = ckpt
    prompts = [prompt_of(n, seed=n) for n in (3, 17, 29, 41)[:batch]]
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for draft in (None, assistant):
        graphed = gpu_llm(target, draft, num_draft_tokens=3, adaptive_draft_length=False)
        eager = gpu_llm(target, draft, num_draft_tokens=3, enforce_eager=True)
        assert graphed.engine.runner.graphs is not None and eager.engine.runner.graphs is None
        a = [o.token_ids for o in graphed.generate(prompts, sp)]
        b = [o.token_ids for o in eager.generate(prompts, sp)]
        assert a == b, f"draft={draft is not None}"


def test_greedy_head_equals_full_logits(ckpt, monkeypatch):
    """Greedy-head tokens (graph variants and eager steps) = the argmax of the full logits.

    Token for token, with and without the drafter: the head is exact, not a near-tie approximation.
    """
    variant, target, assistant = ckpt
    prompts = [prompt_of(n, seed=n) for n in (3, 17, 29, 41)]
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for draft in (None, assistant):
        kw = dict(num_draft_tokens=3, adaptive_draft_length=False)
        head = gpu_llm(target, draft, **kw)
        assert head.engine.state.target.greedy_head is not None
        assert (1, 1, True) in head.engine.runner.graphs.target_graphs
        with monkeypatch.context() as m:
            m.setenv("GEMMA4SERVE_DISABLE_GREEDY_HEAD", "1")
            full = gpu_llm(target, draft, **kw)
        assert full.engine.state.target.greedy_head is None
        for batch in (1, 4):
            a = [o.token_ids for o in head.generate(prompts[:batch], sp)]
            b = [o.token_ids for o in full.generate(prompts[:batch], sp)]
            assert a == b, f"draft={draft is not None} batch={batch}"


def test_nan_hidden_states_give_token_zero_and_the_engine_lives_on(ckpt):
    """A hidden state gone NaN (a broken checkpoint, an overflow) gives token 0, torch's argmax of
    all-NaN logits, on each greedy path: the greedy head (one sequence, 4 rows), the first maximum
    past its 16 rows (8 sequences x 4 rows), the drafter's head. An id outside the vocabulary would
    reach the next step's embedding, and its device assert would end the process."""
    variant, target, assistant = ckpt
    # No prefix cache: the last run must compute what the first did, row for row.
    llm = gpu_llm(
        target,
        assistant,
        num_draft_tokens=3,
        adaptive_draft_length=False,
        enable_prefix_caching=False,
    )
    prompts = [prompt_of(n, seed=n) for n in (3, 17, 29, 41, 5, 8, 13, 21)]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    free0 = llm.engine.kv_pool_free()
    before = [o.token_ids for o in llm.generate(prompts, sp)]
    norm = llm.engine.state.target.norm.weight  # the graphs read it in place
    saved = norm.clone()
    norm.fill_(float("nan"))
    for batch in (1, 8):
        assert [o.token_ids for o in llm.generate(prompts[:batch], sp)] == [[0] * 12] * batch
    norm.copy_(saved)
    assert [o.token_ids for o in llm.generate(prompts, sp)] == before
    assert llm.engine.kv_pool_free() == free0


def test_choices_of_one_prompt_share_its_prefill(ckpt):
    """n = 4 greedy choices of one prompt, on the GPU's graphs and kernels: three start from the
    first one's rows in the step that writes them (the prompt and their tails fit one step), and
    each emits what an engine without the prefix cache does (or parts from it at a near-tie)."""
    variant, target, assistant = ckpt
    judge = load_hf_target(target, dtype=torch.float32, device="cuda")
    noisy = load_hf_target(target, dtype=torch.bfloat16, device="cuda")
    cached = gpu_llm(target, assistant)
    plain = gpu_llm(target, assistant, enable_prefix_caching=False)
    prompt = prompt_of(300, seed=3)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    free0 = cached.engine.kv_pool_free()
    (want,) = plain.generate([prompt], greedy)
    (got,) = cached.generate([prompt], dataclasses.replace(greedy, n=4))
    boundary = cached.engine.kv.cache.boundary
    hits = cached.engine.snapshot().prefix_cache_hits
    assert hits == 3 * ((len(prompt) - 1) // boundary * boundary)
    assert len(got.outputs) == 4
    for choice in got.outputs:
        assert_same_or_near_tie(choice.token_ids, want.token_ids, prompt, judge, noisy)
    assert cached.engine.kv_pool_free() == free0


@pytest.mark.parametrize("k", [1, 3, 6])
def test_mtp_greedy_equals_plain_bf16(ckpt, k):
    variant, target, assistant = ckpt
    judge = load_hf_target(target, dtype=torch.float32, device="cuda")
    noisy = load_hf_target(target, dtype=torch.bfloat16, device="cuda")
    spec = gpu_llm(target, assistant, num_draft_tokens=k)
    plain = gpu_llm(target)
    prompts = [prompt_of(n, seed=n) for n in (2, 11, 37)]
    sp = SamplingParams(max_tokens=33, temperature=0.0, ignore_eos=True)
    free0 = spec.engine.kv_pool_free()
    with_draft = [o.token_ids for o in spec.generate(prompts, sp)]
    without = [o.token_ids for o in plain.generate(prompts, sp)]
    for p, a, b in zip(prompts, with_draft, without):
        assert_same_or_near_tie(a, b, p, judge, noisy)
    assert spec.engine.kv_pool_free() == free0
    assert spec.engine.snapshot().spec_num_steps > 0


def test_async_scheduling_equals_sync(ckpt):
    """Steps queued before the previous step's tokens are read emit what the sync engine emits.

    These are graph replays fed from device outputs, for requests that end at different steps.
    """
    variant, target, assistant = ckpt
    prompts = [prompt_of(n, seed=n) for n in (3, 17, 29, 41)]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (9, 24, 31)]
    params.append(
        SamplingParams(
            max_tokens=40, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True, logprobs=2
        )
    )
    for draft, forced in ((None, None), (assistant, None), (assistant, 4.0)):
        # A fixed k: the adaptive draft length decides from step costs each engine measures at
        # start, so two engines could pick different k for a batch size and round a token
        # differently (verify rows vs 1-token rows), which is not what this test is about.
        kw = dict(num_draft_tokens=3, forced_acceptance=forced, adaptive_draft_length=False)
        on, off = gpu_llm(target, draft, **kw), gpu_llm(target, draft, async_scheduling=False, **kw)
        free0 = on.engine.kv_pool_free()
        a = [(o.token_ids, o.outputs[0].finish_reason) for o in on.generate(prompts, params)]
        b = [(o.token_ids, o.outputs[0].finish_reason) for o in off.generate(prompts, params)]
        assert a == b, f"draft={draft is not None} forced={forced}"
        assert on.engine.num_continued_steps >= 5 and off.engine.num_continued_steps == 0
        assert on.engine.kv_pool_free() == free0


def test_async_scheduling_equals_sync_through_arrivals_and_prompt_chunks(ckpt):
    """Continued steps that drop finished sequences, take in waiting requests and carry prompts'
    next chunks (mixed steps whose key lengths are on the device only) emit what the sync engine
    emits. Three sequences at most and a 64-token budget: later requests wait, prompts come in
    chunks."""
    variant, target, assistant = ckpt
    prompts = [prompt_of(n, seed=100 + n) for n in (90, 7, 150, 33, 120, 61)]
    params = [
        SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
        for m in (12, 30, 9, 25, 17, 21)
    ]
    kw = dict(
        num_draft_tokens=3,
        forced_acceptance=4.0,
        adaptive_draft_length=False,
        max_num_seqs=3,
        max_num_batched_tokens=64,
    )
    on, off = (
        gpu_llm(target, assistant, **kw),
        gpu_llm(target, assistant, async_scheduling=False, **kw),
    )
    free0 = on.engine.kv_pool_free()
    continued_prompts = []
    launch_continued = on.engine.runner.launch_continued

    def counted(previous, pages, draft_len, keep=None, prompt_chunks=()):
        continued_prompts.extend(chunk.samples for chunk in prompt_chunks)
        return launch_continued(previous, pages, draft_len, keep, prompt_chunks)

    on.engine.runner.launch_continued = counted
    a = [o.outputs[0].token_ids for o in on.generate(prompts, params)]
    b = [o.outputs[0].token_ids for o in off.generate(prompts, params)]
    assert a == b
    # both a prompt's middle chunk and a prompt's last chunk went on on the device
    assert False in continued_prompts and True in continued_prompts
    assert on.engine.kv_pool_free() == free0


def test_async_scheduling_equals_sync_under_a_grammar(ckpt):
    """Constrained decode steps continued on the device (a graph replay of the forward, the
    sampling queued once the step before is committed) emit what the sync engine emits."""
    variant, target, assistant = ckpt
    prompts = [prompt_of(n, seed=n) for n in (3, 17, 29)]
    json_object = StructuredOutputsParams(json_object=True)
    params = [
        SamplingParams(max_tokens=m, temperature=0.0, structured_outputs=json_object)
        for m in (12, 30, 41)
    ]
    for draft in (None, assistant):
        kw = dict(num_draft_tokens=3, adaptive_draft_length=False)
        on, off = gpu_llm(target, draft, **kw), gpu_llm(target, draft, async_scheduling=False, **kw)
        a = [o.outputs[0].token_ids for o in on.generate(prompts, params)]
        b = [o.outputs[0].token_ids for o in off.generate(prompts, params)]
        assert a == b, f"draft={draft is not None}"
        assert on.engine.num_continued_steps >= 5 and off.engine.num_continued_steps == 0


def test_adaptive_draft_length_switches_graphs(ckpt):
    """Two drafts for a batch of four and three for a lone sequence (given step costs).

    Graphed steps switch between the verify graphs of both lengths (and their draft loops) and
    emit the synchronous, fixed-k engine's tokens.
    """
    from gemma4serve.engine.spec import DraftLength, StepCost

    variant, target, assistant = ckpt
    prompts = [prompt_of(n, seed=n) for n in (5, 12, 19, 26)]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (40, 8, 8, 8)]
    adaptive = gpu_llm(target, assistant, num_draft_tokens=3)
    fixed = gpu_llm(
        target, assistant, num_draft_tokens=3, adaptive_draft_length=False, async_scheduling=False
    )
    assert adaptive.engine.draft_length.costs  # measured on the graphs at start
    adaptive.engine.draft_length = DraftLength(  # 3 drafts alone, 2 for 2-4 sequences
        3,
        {
            1: StepCost(1.0, {2: 1.0, 3: 1.0}, {2: 0.1, 3: 0.1}),
            4: StepCost(1.0, {2: 1.2, 3: 9.0}, {2: 0.2, 3: 1.0}),
            8: StepCost(1.0, {2: 9.0, 3: 9.0}, {2: 1.0, 3: 1.0}),
        },
    )
    judge = load_hf_target(target, dtype=torch.float32, device="cuda")
    noisy = load_hf_target(target, dtype=torch.bfloat16, device="cuda")
    a = [o.token_ids for o in adaptive.generate(prompts, params)]
    b = [o.token_ids for o in fixed.generate(prompts, params)]
    for p, x, y in zip(prompts, a, b):  # 1-token and verify rows may round differently in bf16
        assert_same_or_near_tie(x, y, p, judge, noisy)
    stats = adaptive.engine.snapshot()
    assert 0 < stats.spec_num_steps < stats.seq_steps
    # both lengths verified: 2 or 3 drafts per sequence step
    assert 2 * stats.spec_num_steps < stats.spec_drafted_tokens < 3 * stats.spec_num_steps


def test_steps_make_no_implicit_host_sync(ckpt):
    """After start-up no step waits for the GPU without asking (each builds and queues its inputs
    while the step before still runs): under torch's sync debug mode, set to raise, prompts arrive
    and come in chunks beside running sequences, with greedy and sampled rows, drafts and their
    verification. The engine's own waits for a step's outputs (CUDA events) are outside what the
    mode watches."""
    variant, target, assistant = ckpt
    llm = gpu_llm(target, assistant, num_draft_tokens=3, max_num_seqs=3, max_num_batched_tokens=64)
    llm.generate([prompt_of(20, seed=1)], SamplingParams(max_tokens=4, ignore_eos=True))
    prompts = [prompt_of(n, seed=200 + n) for n in (90, 7, 150, 33)]
    params = [
        SamplingParams(max_tokens=12, temperature=temperature, seed=i, ignore_eos=True)
        for i, temperature in enumerate((0.0, 0.8, 0.0, 1.0))
    ]
    torch.cuda.set_sync_debug_mode("error")
    try:
        outputs = llm.generate(prompts, params)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [len(output.outputs[0].token_ids) for output in outputs] == [12] * 4


@contextlib.contextmanager
def _cold_kernel_caches():
    """Every kernel's in-process cache emptied (so variants that earlier tests compiled do not
    hide a missing warm-up), restored after; yields each kernel's variants compiled since (their
    keys: specialisation and constants)."""
    from gemma4serve_kernels._common import jit_kernels

    fns = jit_kernels()
    # Kept alive: earlier graphs may still point at them.
    saved = {f: dict(f.device_caches) for f in fns}
    try:
        for f in fns:
            f.device_caches.clear()
        yield lambda: {
            f.__name__: frozenset(key for c in f.device_caches.values() for key in c[0])
            for f in fns
        }
    finally:
        for f, caches in saved.items():
            f.device_caches.update(caches)


def _new_variants(start: dict, now: dict) -> dict:
    """The variants compiled between two readings of `_cold_kernel_caches`, by kernel."""
    return {
        name: sorted(map(str, now[name] - start[name])) for name in now if now[name] != start[name]
    }


def test_no_kernel_compiles_while_serving(ckpt):
    """After start-up, prompts of any length run on kernels compiled already.

    Start-up is graph capture, every attention variant the launches can take, then one eager step
    per chunk-length bucket; prompts run alone and batched, with drafts, and short prompts' logprobs
    (eager steps whose longest group is short). A compile would stall every running request (about
    a second each on a cold cache).
    """
    variant, target, assistant = ckpt
    with _cold_kernel_caches() as compiled:
        llm = gpu_llm(target, assistant, num_draft_tokens=3)
        start = compiled()
        sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        for lens in (
            [1],
            [2],
            [3],
            [7],
            [9],
            [13],
            [16],
            [17],
            [31],
            [40],
            [100],
            [300],
            [511],
            [700],
            [5, 9, 300],
            [1, 2, 3, 4],
            [12] * 5,
        ):
            llm.generate([prompt_of(n, seed=n) for n in lens], sp)
            new = _new_variants(start, compiled())
            assert not new, f"prompts of {lens} tokens compiled {new}"
        scored = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=0)
        for lens in ([9], [12], [16], [17], [5, 14], [40, 9, 9]):
            llm.generate([prompt_of(n, seed=n) for n in lens], scored)
            new = _new_variants(start, compiled())
            assert not new, f"the logprobs of {lens}-token prompts compiled {new}"
        assert any(start.values())


def _wide_full_heads(tmp_path: Path, monkeypatch) -> Path:
    """The dense tiny target with the 31B's full-layer heads (512 wide, 8 query heads to a KV
    head), whose prefill tiles a long prefix changes, and 16,384 positions."""
    from gemma4serve.demo import checkpoints

    dense = checkpoints.target_text_config("dense")
    wide = dict(dense, num_attention_heads=8, global_head_dim=512, max_position_embeddings=16384)
    monkeypatch.setattr(checkpoints, "target_text_config", lambda variant: wide)
    return checkpoints.write_tiny_checkpoint(tmp_path / "wide", "dense", release_format=False)


def test_chunks_over_a_long_prefix_run_eagerly_on_warm_kernels(tmp_path, monkeypatch):
    """Long steps whose chunks reach positions enough to change their full layers' attention
    tiles (`context_changes_tiles`) run eagerly, since a captured graph cannot see the context, on
    kernels the warm-up compiled, and give the tokens of an engine without graphs. A
    10,000-token prompt in chunks of 2048: those ending at 2048 to 6144 replay graphs, those
    ending at 8192 and 10,000 do not."""
    target = _wide_full_heads(tmp_path, monkeypatch)
    # The tiny model's steps are short: let them leave their graphs as the 31B's do.
    monkeypatch.setattr(cuda_graphs, "EAGER_STEP_FLOPS", 0)
    settings = dict(max_num_batched_tokens=2048, max_model_len=12288)
    prompt = prompt_of(10_000, seed=3)
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with _cold_kernel_caches() as compiled:
        llm = gpu_llm(target, **settings)
        graphs, chose = llm.engine.runner.graphs, []
        fits_mixed = graphs.fits_mixed

        def recorded(batch):
            chose.append((batch.chunk_context, fits_mixed(batch)))
            return chose[-1][1]

        graphs.fits_mixed = recorded
        start = compiled()
        got = llm.generate([prompt], sp)[0].token_ids
        assert not _new_variants(start, compiled())
    assert [fits for context, fits in chose if context] == [True, True, True, False, False]
    assert [context for context, _ in chose if context] == [2048, 4096, 6144, 8192, 10_000]
    eager = gpu_llm(target, enforce_eager=True, **settings)
    assert got == eager.generate([prompt], sp)[0].token_ids


def test_a_step_eager_for_its_logprobs_compiles_nothing(tmp_path, monkeypatch):
    """A step that leaves its graph for another reason than its context (a prompt's logprobs read
    every row) takes the attention tiles its context picks, which the start compiled with every
    other variant (`compile_attention_variants`): the tiny model with the 31B's full heads keeps
    its graphs over a long prefix (its steps are below the floor of work), and scoring a
    10,000-token prompt, whose chunks reach 8192 and 10,000 positions, compiles no attention
    variant after start."""
    target = _wide_full_heads(tmp_path, monkeypatch)
    sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    with _cold_kernel_caches() as compiled:
        llm = gpu_llm(target, max_num_batched_tokens=2048, max_model_len=12288)
        start = compiled()
        out = llm.generate([prompt_of(10_000, seed=4)], sp)[0]
        assert "_attn_kernel" not in _new_variants(start, compiled())
    assert len(out.prompt_logprobs) == 10_000
