"""Prefix caching and the on-demand KV arena: outputs equal those without caching, hits are real,
pages come back.

Each engine here runs the tiny models on CPU. Outputs with the cache on are compared token for
token with an engine that has it off, for prefixes that end mid-page and on a boundary, across
eviction (a small arena), preemption, MTP, and the MoE and KV-shared (PLE) variants.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

from gemma4serve.engine.args import EngineArgs
from gemma4serve.engine.engine import LLMEngine
from gemma4serve.sampling_params import SamplingParams

_ids = itertools.count()


def make_engine(tiny_checkpoints, variant="dense", **kw) -> LLMEngine:
    args = dict(
        model=str(tiny_checkpoints.get(variant)),
        draft=str(tiny_checkpoints.get_assistant(variant)),
        device="cpu",
        dtype="float32",
        num_draft_tokens=3,
        page_size=4,
        max_num_batched_tokens=64,
        max_num_seqs=16,
        max_model_len=512,
        kv_cache_tokens=2048,
    )
    args.update(kw)
    return LLMEngine(EngineArgs(**args))


def prompt_of(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [2] + torch.randint(110, 500, (n - 1,), generator=g).tolist()


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams):
    """Run the prompts together; [(token ids, cached tokens)] in order."""
    ids = []
    for prompt in prompts:
        rid = f"r{next(_ids)}"
        engine.add_request(rid, prompt, params)
        ids.append(rid)
    done = {}
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [(done[r].outputs[0].token_ids, done[r].num_cached_tokens) for r in ids]


def run_each(engine, prompts, params):
    """One after another, so later prompts can hit what earlier ones left."""
    return [run(engine, [p], params)[0] for p in prompts]


def assert_idle(engine: LLMEngine) -> None:
    pool = engine.kv.pool
    assert not engine.has_unfinished()
    assert engine.kv_pool_free() == pool.capacity  # idle cached pages count as free
    assert all(r == 0 for r in pool.refs)
    engine.reset_prefix_cache()
    assert len(pool._free) == pool.capacity and not pool.idle  # nothing left claimed


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def plain(tiny_checkpoints):
    return make_engine(tiny_checkpoints, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def cached(tiny_checkpoints):
    return make_engine(tiny_checkpoints)


def chat_turns(seed: int) -> list[list[int]]:
    """A conversation: each prompt extends the previous one (a shared system prompt, then turns)."""
    system = prompt_of(150, seed)
    turns = [system + prompt_of(9, seed + 1)[1:]]
    for i in range(3):
        turns.append(turns[-1] + prompt_of(23 + 7 * i, seed + 10 + i)[1:])
    return turns


def test_boundaries_and_page_sizes(cached):
    kv, cache = cached.kv, cached.kv.cache
    tokens = cached.state.kv_plan.page_tokens
    assert cache.boundary % tokens["full_attention"] == 0
    assert cache.boundary % tokens["sliding_attention"] == 0
    # Equal-byte pages: each type's tokens per page x its bytes per token fit one page.
    assert kv.pool.capacity + 1 == cached.state.kv.arena.shape[0]


def test_greedy_equal_with_and_without_cache(plain, cached):
    prompts = chat_turns(1)
    reference = run_each(plain, prompts, GREEDY)
    got = run_each(cached, prompts, GREEDY)
    assert [t for t, _ in got] == [t for t, _ in reference]
    assert got[0][1] == 0  # nothing cached yet
    boundary = cached.kv.cache.boundary
    for (_, hit), prompt in zip(got[1:], prompts[1:]):
        assert hit > 0 and hit % boundary == 0 and hit < len(prompt)
    # The same prompt again: served up to its last boundary before the last token.
    again = run(cached, [prompts[-1]], GREEDY)[0]
    assert again[0] == reference[-1][0]
    assert again[1] == (len(prompts[-1]) - 1) // boundary * boundary
    st = cached.snapshot()
    assert st.prefix_cache_hits > 0 and st.prefix_cache_queries >= st.prefix_cache_hits
    assert_idle(cached)


@pytest.mark.parametrize("cut", ["boundary", "mid-page", "one-past"])
def test_prefix_ending_anywhere(plain, cached, cut):
    boundary = cached.kv.cache.boundary
    base = prompt_of(4 * boundary + 3, 7)
    end = {"boundary": 3 * boundary, "mid-page": 3 * boundary + 2, "one-past": 3 * boundary + 1}
    first = base[: end[cut]] + prompt_of(5, 8)[1:]
    second = base[: end[cut]] + prompt_of(5, 9)[1:]
    reference = run_each(plain, [first, second], GREEDY)
    got = run_each(cached, [first, second], GREEDY)
    assert [t for t, _ in got] == [t for t, _ in reference]
    assert got[1][1] > 0
    assert_idle(cached)


def test_sampled_equal_with_and_without_cache(plain, cached):
    params = SamplingParams(max_tokens=10, temperature=0.9, top_k=50, seed=11, ignore_eos=True)
    prompts = chat_turns(3)
    reference = run_each(plain, prompts, params)
    got = run_each(cached, prompts, params)
    assert [t for t, _ in got] == [t for t, _ in reference]
    assert_idle(cached)


def run_choices(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list[list[int]]:
    """One request of params.n choices -> each choice's tokens."""
    rid = f"r{next(_ids)}"
    engine.add_request(rid, prompt, params)
    done = None
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        done = [out for out in engine.step() if out.finished] or done
    return [choice.token_ids for choice in sorted(done[0].outputs, key=lambda c: c.index)]


@pytest.mark.parametrize("length", [60, 150])  # within the 64-token budget, and in chunks
def test_choices_of_one_prompt_share_its_prefill(plain, cached, length):
    """n = 4 choices of a prompt: the first computes it, the others start from its rows (up to
    the cache's last boundary before the prompt's end) as soon as the step that writes them is
    scheduled, in that same step where the budget allows; the tokens equal the uncached ones."""
    cached.reset_prefix_cache()
    prompt = prompt_of(length, 41)
    params = SamplingParams(n=4, max_tokens=8, temperature=0.9, seed=5, ignore_eos=True)
    reference = run_choices(plain, prompt, params)
    before = cached.snapshot().prefix_cache_hits
    got = run_choices(cached, prompt, params)
    assert got == reference and len({tuple(t) for t in got}) > 1
    boundary = cached.kv.cache.boundary
    assert cached.snapshot().prefix_cache_hits - before == 3 * ((length - 1) // boundary * boundary)
    assert_idle(cached)


def test_a_failed_step_leaves_no_rows_it_did_not_write(plain, cached, monkeypatch):
    """A step's rows are in the cache from its scheduling on: when the step fails (its launch
    raises here), the cache is emptied, and the same prompt again computes what an engine
    without the cache does, over an arena of stale values."""
    prompt = prompt_of(60, 7)
    reference = run(plain, [prompt], GREEDY)[0][0]
    cached.reset_prefix_cache()

    def fails(*args, **kwargs):
        raise RuntimeError("launch failed")

    with monkeypatch.context() as patch:
        patch.setattr(cached.runner, "launch", fails)
        cached.add_request("fails", prompt, GREEDY)
        with pytest.raises(RuntimeError, match="launch failed"):
            cached.step()
    cached.abort("fails")
    assert not cached.kv.cache.full and not cached.kv.cache.windows
    cached.state.kv.arena.normal_()  # what was never written is visibly wrong
    assert run(cached, [prompt], GREEDY)[0] == (reference, 0)
    assert_idle(cached)


def test_cache_salt_shares_pages_only_within_one_salt(plain, cached):
    """vLLM's cache_salt: a salted request hits only what requests of its salt left, and an
    unsalted one never hits a salted request's pages; outputs are the same as without a cache."""
    prompt = prompt_of(150, 21)
    reference = run(plain, [prompt], GREEDY)[0][0]

    def salted(salt):
        return replace(GREEDY, cache_salt=salt)

    order = [("a", 0), ("b", 0), (None, 0), ("a", "hit"), ("b", "hit"), (None, "hit"), ("c", 0)]
    for salt, expected in order:
        tokens, hit = run(cached, [prompt], salted(salt))[0]
        assert tokens == reference
        assert (hit > 0) if expected == "hit" else hit == 0, (salt, hit)
    assert_idle(cached)


def test_eviction_under_pressure(tiny_checkpoints, plain):
    """An arena that holds little: cached prefixes are evicted to serve new requests (never a
    page a running sequence reads), and outputs stay exact."""
    small = make_engine(tiny_checkpoints, kv_cache_tokens=400, max_model_len=400)
    conversations = [chat_turns(20 + 5 * i) for i in range(4)]
    prompts = [turn for turns in zip(*conversations) for turn in turns]  # interleaved sessions
    reference = run_each(plain, prompts, GREEDY)
    got = run_each(small, prompts, GREEDY)
    assert [t for t, _ in got] == [t for t, _ in reference]
    # Concurrently too, so that eviction meets running sequences.
    together = run(small, prompts[:8], GREEDY)
    assert [t for t, _ in together] == [t for t, _ in reference[:8]]
    assert_idle(small)


def test_preemption_with_cache(tiny_checkpoints, plain):
    """Many growing requests in a small arena: preempted sequences resume from the cache."""
    small = make_engine(tiny_checkpoints, kv_cache_tokens=300, max_model_len=300)
    # Admissions reserve nothing for the outputs (as if every request stopped at once).
    small.scheduler.expected_end = lambda seq: seq.num_tokens
    prompts = [prompt_of(40 + 13 * i, 50 + i) for i in range(8)]
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    reference = [t for t, _ in run(plain, prompts, params)]
    got = [t for t, _ in run(small, prompts, params)]
    assert got == reference
    assert small.scheduler.num_preemptions > 0
    assert_idle(small)


@pytest.mark.parametrize("variant", ["moe", "ple"])
def test_variants(tiny_checkpoints, variant):
    """The MoE model and the KV-shared (PLE) layers read cached pages like their own."""
    plain = make_engine(tiny_checkpoints, variant, enable_prefix_caching=False)
    cached = make_engine(tiny_checkpoints, variant)
    prompts = chat_turns(30)
    reference = run_each(plain, prompts, GREEDY)
    got = run_each(cached, prompts, GREEDY)
    assert [t for t, _ in got] == [t for t, _ in reference]
    assert all(hit > 0 for _, hit in got[1:])
    assert_idle(cached)


def test_budget_smaller_than_one_prefill_chunk(tiny_checkpoints, plain):
    """An arena smaller than one full prefill chunk's sliding rows still serves: the scheduler
    shortens the chunk to what fits."""
    tight = make_engine(
        tiny_checkpoints, kv_cache_tokens=200, max_model_len=200, max_num_batched_tokens=256
    )
    prompt = prompt_of(180, 77)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert run(tight, [prompt], params)[0][0] == run(plain, [prompt], params)[0][0]
    assert_idle(tight)
