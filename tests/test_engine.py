"""The engine end to end on the tiny dense checkpoint: CPU, fp32, MTP drafter on (k=3).

The oracle for a batch is the same engine running one request alone: greedy and seeded requests
must come out identical whatever else shares their steps (chunked prefill, preemption, aborts, other
sampling settings), because the sampler's randomness is keyed by (seed, position). Every run also
checks the streaming contract: the deltas of a request, concatenated, are exactly its final tokens
and text (nothing emitted twice or lost).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import random
from dataclasses import dataclass, field

import pytest
import torch

import gemma4serve.engine.runner as runner_module
from gemma4serve.config import load_config
from gemma4serve.detokenizer import IncrementalDetokenizer
from gemma4serve.engine.args import EngineArgs
from gemma4serve.engine.cuda_graphs import leaves_graph_for_context, matmul_flops_per_row
from gemma4serve.engine.engine import LLMEngine
from gemma4serve.engine.llm import LLM
from gemma4serve.engine.output_processor import OutputProcessor
from gemma4serve.engine.outputs import ITERATION_TOKEN_BUCKETS, RequestOutput
from gemma4serve.engine.spec import DraftLength, StepCost, draft_choices
from gemma4serve.engine_process.client import EngineProcessClient
from gemma4serve.model.gemma4 import Gemma4Model
from gemma4serve.sampling_params import SamplingParams
from gemma4serve_kernels import LONG_PREFIX

K = 3  # draft tokens per step
EOS = {1, 106, 50}  # the tiny checkpoints' generation_config, as in the released IT models
VOCAB = 512
BYTE_TOKENS = range(107, 363)  # <0x00>..<0xFF> in the tiny tokenizer
MAX_STEPS = 5000  # a run that needs more is stuck: fail rather than hang

# The main engine: a full pool of 64 pages of 4 tokens that 64 growing requests cannot share
# (preemption, also of sequences that are decoding), and a 48-token budget that long prompts need
# several steps for (chunked prefill). max_model_len is above what the pool holds, so the "does not
# fit the KV cache" check is reachable.
MAIN = dict(
    kv_cache_tokens=256, page_size=4, max_num_batched_tokens=48, max_num_seqs=64, max_model_len=1024
)

_ids = itertools.count()


def engine_args(tiny_checkpoints, variant: str = "dense", **kw) -> EngineArgs:
    return EngineArgs(
        model=str(tiny_checkpoints.get(variant)),
        draft=str(tiny_checkpoints.get_assistant(variant)),
        device="cpu",
        dtype="float32",
        num_draft_tokens=K,
        **kw,
    )


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Run torch on one thread for this module.

    The tiny model's ops are far too small to split across threads; with two threads on a busy
    2-core machine the OpenMP hand-offs make every step 10-30x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def engine(tiny_checkpoints) -> LLMEngine:
    return LLMEngine(engine_args(tiny_checkpoints, **MAIN))


@pytest.fixture(scope="module")
def forced(tiny_checkpoints) -> LLMEngine:
    """An engine with every draft accepted.

    After the prefill each step emits k+1 = 4 tokens, so a step regularly runs past a stop condition
    and must be cut. (The tokens are the drafter's, not the model's: fine for stop logic.)"""
    return LLMEngine(
        engine_args(
            tiny_checkpoints,
            forced_acceptance=float(K + 1),
            kv_cache_tokens=2048,
            max_model_len=64,
            max_num_batched_tokens=256,
        )
    )


@pytest.fixture(params=["mtp", "forced"])
def any_engine(request, engine, forced) -> LLMEngine:
    return engine if request.param == "mtp" else forced


# ---- helpers ------------------------------------------------------------------------------------


def all_free(engine: LLMEngine) -> int:
    """The free count of an idle engine: every arena page (page 0, the null page, is never handed
    out; idle prefix-cache pages count as free)."""
    return engine.kv.pool.capacity


@dataclass
class Run:
    final: dict[str, RequestOutput] = field(default_factory=dict)
    deltas: dict[tuple, list[list[int]]] = field(
        default_factory=dict
    )  # (rid, choice) -> new_token_ids per output
    text_deltas: dict[tuple, list[str]] = field(default_factory=dict)
    logprobs: dict[tuple, list] = field(
        default_factory=dict
    )  # (rid, choice) -> TokenLogprob per token
    steps: int = 0

    def record(self, out: RequestOutput) -> None:
        for c in out.outputs:
            if c.new_token_ids or c.new_text:
                self.deltas.setdefault((out.request_id, c.index), []).append(list(c.new_token_ids))
                self.text_deltas.setdefault((out.request_id, c.index), []).append(c.new_text)
            if c.new_logprobs is not None:
                assert [lp.token_id for lp in c.new_logprobs] == c.new_token_ids
                self.logprobs.setdefault((out.request_id, c.index), []).extend(c.new_logprobs)
        if out.finished:
            assert out.request_id not in self.final, f"{out.request_id} finished twice"
            self.final[out.request_id] = out

    def check_streams(self) -> None:
        """Streamed deltas concatenated == the final tokens and text.

        No token emitted twice, none lost."""
        for rid, out in self.final.items():
            for c in out.outputs:
                key = (rid, c.index)
                assert sum(self.deltas.get(key, []), []) == c.token_ids, key
                assert "".join(self.text_deltas.get(key, [])) == c.text, key


def step(engine: LLMEngine, run: Run) -> list[RequestOutput]:
    outs = engine.step()
    run.steps += 1
    assert run.steps < MAX_STEPS, "the engine stopped making progress"
    for out in outs:
        run.record(out)
    return outs


def run_requests(engine: LLMEngine, requests: dict, on_step=None) -> Run:
    """Add {rid: (prompt, params)}, step until idle.

    `on_step(run, outputs)` is called after every step."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    run = Run()
    while engine.has_unfinished():
        outs = step(engine, run)
        if on_step is not None:
            on_step(run, outs)
    run.check_streams()
    return run


def solo(engine: LLMEngine, prompt, params: SamplingParams) -> tuple[RequestOutput, Run]:
    rid = f"solo-{next(_ids)}"
    run = run_requests(engine, {rid: (prompt, params)})
    return run.final[rid], run


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def prompt_of(length: int, salt: int) -> list[int]:
    rng = random.Random(salt)
    return [rng.randrange(3, VOCAB) for _ in range(length)]


def choices(out: RequestOutput) -> list[tuple]:
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in out.outputs]


# ---- 64 concurrent requests ---------------------------------------------------------------------


def mixed_requests(n: int) -> list[tuple[list[int], SamplingParams, bool]]:
    """(prompt, params, reproducible) for n requests of mixed prompt lengths and sampling
    settings."""
    rng = random.Random(1234)
    settings = [
        lambda s, m: SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True),
        lambda s, m: SamplingParams(temperature=0.0, max_tokens=m),  # may stop on EOS
        lambda s, m: SamplingParams(
            temperature=0.0,
            max_tokens=m,
            ignore_eos=True,
            logprobs=2,
            repetition_penalty=1.3,
            presence_penalty=0.5,
            frequency_penalty=0.4,
        ),
        lambda s, m: SamplingParams(
            temperature=0.8, top_k=20, seed=s, max_tokens=m, ignore_eos=True
        ),
        lambda s, m: SamplingParams(
            temperature=1.0, top_p=0.9, seed=s, max_tokens=m, ignore_eos=True, logprobs=3
        ),
        lambda s, m: SamplingParams(
            temperature=1.3, min_p=0.05, seed=s, max_tokens=m, ignore_eos=True
        ),
        lambda s, m: SamplingParams(
            temperature=0.7,
            top_k=50,
            top_p=0.95,
            min_p=0.02,
            frequency_penalty=0.5,
            repetition_penalty=1.1,
            seed=s,
            max_tokens=m,
            ignore_eos=True,
        ),
        lambda s, m: SamplingParams(temperature=1.0, n=2, seed=s, max_tokens=m, ignore_eos=True),
        lambda s, m: SamplingParams(temperature=1.0, max_tokens=m, ignore_eos=True),  # unseeded
        lambda s, m: SamplingParams(
            temperature=0.0, max_tokens=m, ignore_eos=True, stop_token_ids=[200, 300]
        ),
        lambda s, m: SamplingParams(
            temperature=0.0, max_tokens=m, ignore_eos=True, stop=["a", " t"]
        ),
    ]
    out = []
    for i in range(n):
        # Lengths around the windows (target 8, drafter 12), and beyond the 48-token step budget.
        length = rng.choice([1, 3, 8, 9, 13, 20, 33, 65, 100, 150])
        params = settings[i % len(settings)](1000 + i, rng.choice([3, 5, 8, 10, 16, 24]))
        out.append((prompt_of(length, i), params, params.greedy or params.seed is not None))
    return out


def test_64_concurrent_mixed_requests(engine, monkeypatch):
    assert engine.kv_pool_free() == all_free(engine)
    # Admissions reserve nothing for the outputs (as if every request stopped at once), so the
    # admitted requests outgrow the pool and decoding sequences are preempted.
    monkeypatch.setattr(engine.scheduler, "expected_end", lambda seq: seq.num_tokens)
    reqs = mixed_requests(64)
    assert (
        max(len(p) for p, _, _ in reqs) > engine.scheduler.max_num_batched_tokens
    )  # chunked prefill needed
    solos = {i: solo(engine, p, sp) for i, (p, sp, repro) in enumerate(reqs) if repro}
    preempted_before = engine.scheduler.num_preemptions
    assert engine.kv_pool_free() == all_free(engine)

    seen = set()

    def on_step(run, outs):  # what the scenario is meant to exercise
        sched = engine.scheduler
        if any(0 < s.num_computed < s.num_prompt for s in sched.running):
            seen.add("chunked prefill")
        if any(s.output_ids for s in sched.waiting):
            seen.add("preempted while decoding")  # it must recompute its prompt and its outputs

    run = run_requests(engine, {f"mix-{i}": (p, sp) for i, (p, sp, _) in enumerate(reqs)}, on_step)

    assert seen == {"chunked prefill", "preempted while decoding"}
    assert engine.scheduler.num_preemptions > preempted_before, (
        "the pool was meant to be too small for all 64"
    )
    assert engine.snapshot().num_preemptions == engine.scheduler.num_preemptions
    assert engine.kv_pool_free() == all_free(engine)
    assert len(run.final) == 64
    for i, (prompt, sp, repro) in enumerate(reqs):
        out = run.final[f"mix-{i}"]
        assert out.prompt_token_ids == prompt
        assert len(out.outputs) == sp.n
        for c in out.outputs:
            assert c.finish_reason in ("length", "stop"), (i, c)
            if sp.ignore_eos and not sp.stop_token_ids and not sp.stop:
                assert len(c.token_ids) == sp.max_tokens and c.finish_reason == "length", i
            assert 1 <= len(c.token_ids) <= sp.max_tokens
        if repro:
            assert choices(out) == choices(solos[i][0]), (
                f"request {i} ({sp}) differs from its solo run"
            )
        if sp.logprobs is not None:
            lps = run.logprobs[(f"mix-{i}", 0)]
            assert len(lps) == len(out.token_ids) and all(len(lp.top) == sp.logprobs for lp in lps)
            if repro:  # the same tokens, and the same values up to batch-shape rounding
                ref = solos[i][1].logprobs[(solos[i][0].request_id, 0)]
                assert [lp.logprob for lp in lps] == pytest.approx(
                    [lp.logprob for lp in ref], abs=1e-4
                )


# ---- aborts -------------------------------------------------------------------------------------


def held_pages(engine: LLMEngine, rid: str) -> int:
    """Pages only this request's sequences hold (a page shared with another holder stays held)."""
    pool = engine.kv.pool
    held: dict[int, int] = {}
    for seq in engine.requests[rid].sequences:
        for page in seq.pages.full + [p for p in seq.pages.sliding if p]:
            held[page] = held.get(page, 0) + 1
    return sum(1 for page, n in held.items() if pool.refs[page] == n)


def abort_and_check(engine: LLMEngine, run: Run, rid: str, scheduled: bool = True) -> RequestOutput:
    """Abort between steps.

    The output says "abort" and exactly the request's pages return to the pools."""
    held = held_pages(engine, rid)
    assert (held > 0) == scheduled
    free = engine.kv_pool_free()
    out = engine.abort(rid)
    assert out is not None and out.finished
    assert [c.finish_reason for c in out.outputs] == ["abort"] * len(out.outputs)
    after = engine.kv_pool_free()
    assert after - free == held
    assert engine.abort(rid) is None  # gone: a second abort is a no-op
    assert rid not in engine.requests
    run.record(out)
    return out


def test_abort_mid_prefill_mid_decode_mid_draft(engine):
    assert engine.kv_pool_free() == all_free(engine)
    keep = {
        "keep-greedy": (prompt_of(30, 11), greedy(10)),
        "keep-long": (prompt_of(90, 12), greedy(6)),
        "keep-seeded": (
            prompt_of(9, 13),
            SamplingParams(temperature=1.0, top_k=40, seed=3, max_tokens=10, ignore_eos=True),
        ),
        "keep-n2": (
            prompt_of(15, 14),
            SamplingParams(temperature=0.9, n=2, seed=4, max_tokens=8, ignore_eos=True),
        ),
        "keep-penalty": (
            prompt_of(20, 15),
            greedy(10, repetition_penalty=1.5, frequency_penalty=1.0),
        ),
    }
    solos = {rid: solo(engine, p, sp)[0] for rid, (p, sp) in keep.items()}
    victims = {
        "prefill": (prompt_of(200, 21), greedy(8)),  # 200 prompt tokens at <= 48 a step
        "decode": (
            prompt_of(10, 22),
            SamplingParams(temperature=1.0, n=2, seed=5, max_tokens=40, ignore_eos=True),
        ),
        "draft": (prompt_of(12, 23), greedy(40)),
    }
    aborted = {}

    def on_step(run, outs):
        touched = {o.request_id for o in outs}
        reqs = engine.requests
        if "prefill" in reqs and "prefill" not in aborted:
            seq = reqs["prefill"].sequences[0]
            if (
                0 < seq.num_computed < seq.num_prompt
            ):  # part of the prompt is in the cache, part is not
                aborted["prefill"] = abort_and_check(engine, run, "prefill")
        if "decode" in reqs and "decode" not in aborted:
            if all(len(s.output_ids) >= 2 for s in reqs["decode"].sequences):
                aborted["decode"] = abort_and_check(engine, run, "decode")
        if "draft" in reqs and "draft" not in aborted:
            seq = reqs["draft"].sequences[0]
            if (
                "draft" in touched and seq.drafts and len(seq.output_ids) >= 3
            ):  # this step just drafted
                aborted["draft"] = abort_and_check(engine, run, "draft")

    # One more that never gets scheduled: aborted while it waits.
    engine.add_request("waiting", prompt_of(5, 24), greedy(4))
    out = abort_and_check(engine, Run(), "waiting", scheduled=False)
    assert out.outputs[0].token_ids == []

    run = run_requests(engine, {**keep, **victims}, on_step)

    assert set(aborted) == set(victims), "every abort point was reached"
    assert aborted["prefill"].outputs[0].token_ids == []
    assert all(
        0 < len(c.token_ids) < 40 for name in ("decode", "draft") for c in aborted[name].outputs
    )
    for rid, ref in solos.items():
        assert choices(run.final[rid]) == choices(ref), rid
    assert engine.kv_pool_free() == all_free(engine)
    assert not engine.has_unfinished() and not engine.scheduler.has_work()


# ---- stop conditions ----------------------------------------------------------------------------


def reference(engine: LLMEngine, prompt, max_tokens: int):
    """A stop-free greedy run: (token ids, tokens of each step, text after each token)."""
    out, run = solo(engine, prompt, greedy(max_tokens))
    steps = run.deltas[(out.request_id, 0)]
    detok = IncrementalDetokenizer(engine.tokenizer)
    texts = []
    for t in out.token_ids:
        detok.push([t])
        texts.append(detok.text)
    return out.token_ids, steps, texts


def overshoots(engine: LLMEngine, steps: list[list[int]]) -> set[int]:
    """Indices j whose step also emitted token j+1: stopping at j must drop the rest of that step.

    On the forced-acceptance engine, the positions a stop test must use (else every position
    qualifies)."""
    if engine.runner.forced is None:
        return set(range(sum(map(len, steps))))
    assert max(map(len, steps)) == K + 1, "forced acceptance should emit k+1 tokens per step"
    out, j = set(), 0
    for d in steps:
        out.update(range(j, j + len(d) - 1))
        j += len(d)
    return out


def test_eos_ids_stop_unless_ignore_eos(any_engine):
    eng = any_engine
    assert eng.eos_ids == EOS
    prompts = {f"eos-{i}": prompt_of(6, 500 + i) for i in range(64)}
    run = run_requests(eng, {rid: (p, greedy(24)) for rid, p in prompts.items()})
    assert all(
        len(o.token_ids) == 24 for o in run.final.values()
    )  # ignore_eos: EOS does not end them
    hits = [
        (rid, next(j for j, t in enumerate(o.token_ids) if t in EOS))
        for rid, o in run.final.items()
        if EOS & set(o.token_ids)
    ]
    assert hits, "no greedy output met an EOS id; try more prompts"
    for rid, j in hits[:3]:
        ids = run.final[rid].token_ids
        out, _ = solo(eng, prompts[rid], SamplingParams(temperature=0.0, max_tokens=24))
        assert out.token_ids == ids[: j + 1]
        assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", ids[j])


def test_stop_token_ids_cut_the_step(any_engine):
    eng = any_engine
    prompt = prompt_of(10, 77)
    ids, steps, _ = reference(eng, prompt, 16)
    mid = overshoots(eng, steps)
    j = next(j for j in range(1, len(ids)) if ids[j] not in ids[:j] and j in mid)
    out, _ = solo(eng, prompt, greedy(16, stop_token_ids=[ids[j]]))
    assert (
        out.token_ids == ids[: j + 1]
    )  # ends at the stop token; what its step drafted after it is gone
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", ids[j])
    assert (
        out.text == solo(eng, prompt, greedy(j))[0].text
    )  # the stop token's own text is not output
    shown, _ = solo(
        eng, prompt, greedy(16, stop_token_ids=[ids[j]], include_stop_str_in_output=True)
    )
    assert shown.token_ids == ids[: j + 1]
    if (
        eng.runner.forced is None
    ):  # forced acceptance's tokens depend on max_tokens: no shorter twin to compare
        assert (
            shown.text == solo(eng, prompt, greedy(j + 1))[0].text
        )  # now with the stop token's text


def test_stop_string_across_tokens(any_engine):
    eng = any_engine
    prompt = prompt_of(10, 78)
    ids, steps, texts = reference(eng, prompt, 24)
    mid = overshoots(eng, steps)
    # A 2-character stop string whose first character is token j's last and whose second is token
    # j+1's first, that does not occur earlier in the text; token j+1 completes it.
    for j in range(1, len(ids) - 1):
        a, b = texts[j - 1], texts[j]
        if len(b) > len(a) and len(texts[j + 1]) > len(b) and j + 1 in mid:
            stop = b[-1] + texts[j + 1][len(b)]
            if (
                stop.isprintable()
                and "\ufffd" not in stop
                and texts[j + 1].find(stop) == len(b) - 1
            ):
                break
    else:
        pytest.fail("no token boundary to put a stop string across")

    out, _ = solo(eng, prompt, greedy(24, stop=[stop]))
    assert out.token_ids == ids[: j + 2]
    assert out.text == b[:-1]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", stop)
    out, _ = solo(
        eng, prompt, greedy(24, stop=["never printed", stop], include_stop_str_in_output=True)
    )
    assert out.token_ids == ids[: j + 2] and out.text == b[:-1] + stop


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 7])
def test_max_tokens_exactly(any_engine, max_tokens):
    prompt = prompt_of(10, 79)
    ids, _, _ = reference(any_engine, prompt, 12)
    out, _ = solo(any_engine, prompt, greedy(max_tokens))
    assert len(out.token_ids) == max_tokens
    if (
        any_engine.runner.forced is None
    ):  # forced acceptance emits drafts, which depend on the room left
        assert out.token_ids == ids[:max_tokens]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("length", None)


@pytest.mark.parametrize("prompt_len", [55, 60, 63])
def test_context_length_ends_generation(forced, prompt_len):
    assert forced.max_model_len == 64
    out, _ = solo(
        forced,
        prompt_of(prompt_len, 80),
        SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True),
    )
    assert len(out.token_ids) == 64 - prompt_len
    assert out.outputs[0].finish_reason == "length"
    assert forced.kv_pool_free() == all_free(forced)


# ---- multi-byte characters ----------------------------------------------------------------------


def test_multibyte_output_streams_whole_characters(engine, monkeypatch):
    """Multi-byte characters are streamed whole.

    Force the engine to emit a text whose CJK and emoji characters are byte-fallback tokens (one
    per step, as drafts are rejected): no delta may carry a U+FFFD or half a character, and a stop
    string made of one multi-byte character ends the output at the byte token that completes it."""
    tok = engine.tokenizer
    text = "日本語 😀 café — ok"
    script = tok.encode(text)
    assert sum(t in BYTE_TOKENS for t in script) >= 12
    prompt = "emoji 🎉 and 漢字 in the prompt"  # the prompt goes through byte fallback too
    n_prompt = 1 + len(tok.encode(prompt))  # the engine puts <bos> before a text prompt
    real_accept = runner_module.accept

    def scripted_accept(logits, drafts, num_drafts, first_position, sb, chosen=None, bitmask=None):
        # Run the real verification, then replace each emitted token by the script's token for its
        # position.
        res = real_accept(logits, drafts, num_drafts, first_position, sb, chosen, bitmask)
        pos = first_position[:, None] + torch.arange(1, res.tokens.shape[1] + 1) - n_prompt
        forced_tokens = torch.tensor(script)[pos.clamp(0, len(script) - 1)]
        res.tokens = torch.where(res.tokens >= 0, forced_tokens, res.tokens)
        return res

    monkeypatch.setattr(runner_module, "accept", scripted_accept)
    out, run = solo(engine, prompt, greedy(len(script)))
    assert out.token_ids == script
    assert out.text == text == tok.decode(out.token_ids)
    released = ""
    for delta in run.text_deltas[(out.request_id, 0)]:
        assert "\ufffd" not in delta
        released += delta
        assert text.startswith(released)

    emoji_end = len(tok.encode("日本語 😀")) - 1
    out, _ = solo(engine, prompt, greedy(len(script), stop=["😀"]))
    assert out.token_ids == script[: emoji_end + 1]
    assert out.text == "日本語 " and out.outputs[0].stop_reason == "😀"
    assert engine.kv_pool_free() == all_free(engine)


def test_detokenizer_byte_tokens(engine):
    tok = engine.tokenizer
    text = "語😀é"
    ids = [tok.token_to_id(f"<0x{b:02X}>") for b in text.encode()]
    d = IncrementalDetokenizer(tok)
    assert [d.push([i])[0] for i in ids] == ["", "", "語", "", "", "", "😀", "", "é"]
    # Generation ending inside a character: only that character becomes U+FFFD, at the end.
    d = IncrementalDetokenizer(tok)
    assert "".join(d.push([i])[0] for i in ids[:-1]) == "語😀"
    assert d.flush() == "\ufffd"
    # A stop string inside a run of byte tokens.
    d = IncrementalDetokenizer(tok, stop=["😀"])
    pieces = [d.push([i]) for i in ids[:7]]
    assert pieces[-1] == ("", "😀") and d.text == "語"


# ---- seeds --------------------------------------------------------------------------------------


def sampled(seed, **kw) -> SamplingParams:
    # Temperature 1.5 on the tiny model's spread logits: flat enough that different seeds part
    # quickly.
    return SamplingParams(temperature=1.5, seed=seed, max_tokens=8, ignore_eos=True, **kw)


def test_seeds_reproduce_across_runs_and_batches(engine):
    prompt = prompt_of(12, 42)
    alone = solo(engine, prompt, sampled(7))[0].token_ids
    assert solo(engine, prompt, sampled(7))[0].token_ids == alone
    run = run_requests(
        engine,
        {
            "a": (prompt, sampled(7)),
            "b": (prompt, sampled(7)),
            "c": (prompt, sampled(8)),
            "d": (prompt, sampled(9)),
            "e": (prompt_of(70, 1), greedy(8)),
            "f": (
                prompt_of(5, 2),
                SamplingParams(temperature=1.0, top_p=0.8, max_tokens=12, ignore_eos=True),
            ),
        },
    )
    tokens = {rid: out.token_ids for rid, out in run.final.items()}
    assert tokens["a"] == tokens["b"] == alone
    assert len({tuple(tokens[r]) for r in "acd"}) == 3, (
        "different seeds should sample different tokens"
    )
    n2 = solo(engine, prompt, sampled(7, n=2))[0]
    assert n2.outputs[0].token_ids != n2.outputs[1].token_ids  # each choice gets its own seed
    # Without a seed every run draws a fresh one.
    unseeded = SamplingParams(temperature=1.5, max_tokens=8, ignore_eos=True)
    assert (
        solo(engine, prompt, unseeded)[0].token_ids != solo(engine, prompt, unseeded)[0].token_ids
    )


def test_speculation_is_lossless(tiny_checkpoints, engine):
    """Greedy and seeded outputs do not depend on whether the drafter runs.

    (Spec §12: the choice at a position depends only on the seed, the position and the target
    distribution.)"""
    args = engine_args(tiny_checkpoints, **MAIN)
    args.draft, args.num_draft_tokens = None, 0
    plain = LLMEngine(args)
    reqs = {
        "g": (prompt_of(25, 5), greedy(12)),
        "p": (prompt_of(60, 6), greedy(10, presence_penalty=1.0, repetition_penalty=1.2)),
        "s": (
            prompt_of(9, 7),
            SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=12, ignore_eos=True),
        ),
        "n": (
            prompt_of(14, 8),
            SamplingParams(
                temperature=1.2, min_p=0.05, n=2, seed=12, max_tokens=12, ignore_eos=True
            ),
        ),
    }
    with_mtp = run_requests(engine, reqs)
    without = run_requests(plain, reqs)
    assert with_mtp.final and engine.snapshot().spec_num_steps > 0
    for rid in reqs:
        assert choices(with_mtp.final[rid]) == choices(without.final[rid]), rid


# ---- async scheduling ---------------------------------------------------------------------------


def async_requests() -> dict:
    """Decoding requests, sampled and greedy, that end in every way at different steps.

    The ways are length, EOS, stop id, stop string and context; the steps differ so that a continued
    step often runs past where its sequence already ended."""
    out = {}
    for i in range(12):
        prompt = prompt_of(5 + 7 * i, 900 + i)
        params = [
            greedy(3 + 7 * i),
            SamplingParams(temperature=0.0, max_tokens=80),  # stops at an EOS, if it meets one
            greedy(60, stop_token_ids=[prompt_of(1, 950 + i)[0], 400 + i]),
            greedy(60, stop=["a", "e "]),
            SamplingParams(
                temperature=0.9, top_k=30, seed=i, max_tokens=9 + 5 * i, ignore_eos=True, logprobs=2
            ),
            SamplingParams(temperature=1.1, top_p=0.9, seed=i, n=2, max_tokens=50, ignore_eos=True),
        ][i % 6]
        out[f"async-{i}"] = (prompt, params)
    return out


@pytest.mark.parametrize("which", ["mtp", "forced", "plain"])
def test_async_scheduling_changes_no_output(tiny_checkpoints, which):
    """A step queued before the previous one is read must not change any output.

    The same tokens, text, finish reasons and streamed deltas as the synchronous engine, and every
    page back after. Eight running sequences at most, so requests wait while others decode."""
    kw = dict(
        kv_cache_tokens=4096,
        page_size=4,
        max_num_batched_tokens=96,
        max_num_seqs=8,
        max_model_len=256,
    )
    if which == "forced":
        kw["forced_acceptance"] = float(K + 1)
    args = engine_args(tiny_checkpoints, **kw)
    if which == "plain":
        args.draft, args.num_draft_tokens = None, 0
    on = LLMEngine(args)
    off = LLMEngine(dataclasses.replace(args, async_scheduling=False))
    reqs = async_requests()
    got, want = run_requests(on, reqs), run_requests(off, reqs)
    assert on.num_continued_steps > got.steps // 4, (
        "steady decoding should continue steps on the device"
    )
    assert off.num_continued_steps == 0
    for rid in reqs:
        assert choices(got.final[rid]) == choices(want.final[rid]), rid
        for c in got.final[rid].outputs:
            assert got.deltas[(rid, c.index)] == want.deltas[(rid, c.index)], rid
    assert {c.finish_reason for o in got.final.values() for c in o.outputs} == {"length", "stop"}
    assert on.kv_pool_free() == all_free(on) and not on.scheduler.has_work()
    if which != "plain":
        assert on.snapshot().spec_num_steps > 0


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_async_scheduling_through_preemptions_changes_no_output(tiny_checkpoints, variant):
    """Continued steps that take in arrivals and prompt chunks beside preemptions (a tight arena,
    admission without the output reservation): the synchronous engine's tokens, every page back.
    Real MTP, not forced acceptance, whose tokens depend on where the steps fall."""
    args = engine_args(
        tiny_checkpoints,
        variant,
        kv_cache_tokens=384,
        page_size=4,
        max_num_batched_tokens=40,
        max_num_seqs=8,
        max_model_len=256,
    )
    on = LLMEngine(args)
    off = LLMEngine(dataclasses.replace(args, async_scheduling=False))
    for engine in (on, off):
        engine.scheduler.expected_end = lambda seq: seq.num_tokens  # admits until it preempts
    reqs = async_requests()
    got, want = run_requests(on, reqs), run_requests(off, reqs)
    assert on.scheduler.num_preemptions > 0 and on.num_continued_steps > got.steps // 2
    for rid in reqs:
        assert choices(got.final[rid]) == choices(want.final[rid]), rid
    assert on.kv_pool_free() == all_free(on) and not on.scheduler.has_work()


def test_text_made_one_step_late_outside_the_engine_changes_no_output(tiny_checkpoints):
    """The engine process's split: an engine that makes no text, and an `OutputProcessor` whose
    stop-string finishes reach the engine one step late (as over the sockets), give the in-process
    engine's tokens, text, finishes, deltas, logprobs and prompt logprobs (which the engine sends
    once); the engine drops the steps it ran past a stop string, and every page comes back."""
    args = engine_args(
        tiny_checkpoints,
        forced_acceptance=float(K + 1),  # 4 tokens a step: stop strings land mid-step
        kv_cache_tokens=4096,
        page_size=4,
        max_num_batched_tokens=96,
        max_num_seqs=8,
        max_model_len=256,
    )
    reqs = async_requests()
    reqs["stops-n2"] = (prompt_of(9, 31), SamplingParams(
        temperature=1.0, seed=3, n=2, max_tokens=40, ignore_eos=True, stop=["e", "a"], logprobs=1
    ))  # fmt: skip
    reqs["stops-include"] = (
        prompt_of(12, 32),
        greedy(40, stop=["o"], include_stop_str_in_output=True),
    )
    reqs["prompt-logprobs"] = (prompt_of(30, 33), greedy(20, prompt_logprobs=2))
    want = run_requests(LLMEngine(args), reqs)
    engine = LLMEngine(dataclasses.replace(args, detokenize=False))
    processor = OutputProcessor(engine.tokenizer)
    for rid, (prompt, params) in reqs.items():
        engine.add_request(rid, prompt, params)
        processor.add_request(rid, prompt, params)
    got, late, prompt_logprobs_sent = Run(), [], 0
    while engine.has_unfinished():
        outputs = step(engine, Run())
        assert not any(c.text or c.new_text or c.token_ids for o in outputs for c in o.outputs)
        prompt_logprobs_sent += sum(o.prompt_logprobs is not None for o in outputs)
        for stop in late:
            engine.stop_choice(stop)
        late = []
        for output in outputs:
            output, stops = processor.process(output)
            late += stops
            if output is not None:
                got.record(output)
    got.check_streams()
    assert prompt_logprobs_sent == 1
    scored = got.final["prompt-logprobs"].prompt_logprobs
    assert len(scored) == 30 and scored == want.final["prompt-logprobs"].prompt_logprobs
    stopped_by_string = 0
    for rid in reqs:
        assert choices(got.final[rid]) == choices(want.final[rid]), rid
        for c in got.final[rid].outputs:
            key = (rid, c.index)
            assert got.deltas[key] == want.deltas[key], rid
            assert [lp.token_id for lp in got.logprobs.get(key, [])] == [
                lp.token_id for lp in want.logprobs.get(key, [])
            ]
            stopped_by_string += isinstance(c.stop_reason, str)
    assert stopped_by_string >= 4
    assert engine.kv_pool_free() == all_free(engine) and not engine.scheduler.has_work()


def test_steps_go_on_on_the_device_through_arrivals_and_finishes(tiny_checkpoints):
    """The step after a prompt, a step that takes in an arriving request's prompt, and a step
    after a sequence ended are all queued before the step before them is read: only the very
    first step is scheduled on the host. Same tokens as the synchronous engine, every page back."""
    args = engine_args(tiny_checkpoints, forced_acceptance=float(K + 1), page_size=4)
    reqs = {"first": (prompt_of(21, 71), greedy(30)), "second": (prompt_of(13, 72), greedy(50))}
    want = run_requests(LLMEngine(dataclasses.replace(args, async_scheduling=False)), reqs)
    engine = LLMEngine(args)
    scheduled = []
    launch = engine.runner.launch
    engine.runner.launch = lambda *a: scheduled.append(1) or launch(*a)
    run = Run()
    engine.add_request("first", *reqs["first"])
    step(engine, run)  # the prompt alone: its first token and drafts; the next step is queued
    assert engine._inflight is not None and engine.num_continued_steps == 1
    while engine.num_continued_steps < 3:
        step(engine, run)
    engine.add_request("second", *reqs["second"])
    while engine.has_unfinished():
        step(engine, run)
    assert len(scheduled) == 1 and engine.num_continued_steps > 10
    run.check_streams()
    for rid in reqs:
        assert choices(run.final[rid]) == choices(want.final[rid]), rid
    assert engine.kv_pool_free() == all_free(engine) and not engine.scheduler.has_work()


def test_a_prompt_in_chunks_goes_on_on_the_device(tiny_checkpoints):
    """A prompt longer than the token budget arrives beside a running request: every chunk of
    it after the first step is queued before the step before it is read, and so is the step
    after its last chunk; each of those steps' forwards knows how far its chunk reaches (the
    attention tiles follow it). Same tokens as the synchronous engine, every page back."""
    args = engine_args(
        tiny_checkpoints, forced_acceptance=float(K + 1), page_size=4, max_num_batched_tokens=16
    )
    reqs = {"first": (prompt_of(9, 73), greedy(40)), "long": (prompt_of(45, 74), greedy(20))}
    want = run_requests(LLMEngine(dataclasses.replace(args, async_scheduling=False)), reqs)
    engine = LLMEngine(args)
    scheduled, chunked, chunk_ends, chunk_contexts = [], [], [9], []
    launch, launch_continued = engine.runner.launch, engine.runner.launch_continued
    forward = engine.runner.forward

    def continued(previous, pages, draft_len, keep=None, prompt_chunks=()):
        chunked.extend(chunk for chunk in prompt_chunks if not chunk.samples)
        chunk_ends.extend(c.start + c.length for c in prompt_chunks if c.length > 1)
        return launch_continued(previous, pages, draft_len, keep, prompt_chunks)

    def recorded_forward(batch, *, greedy):
        chunk_contexts.append(batch.chunk_context)
        return forward(batch, greedy=greedy)

    engine.runner.launch = lambda *a: scheduled.append(1) or launch(*a)
    engine.runner.launch_continued = continued
    engine.runner.forward = recorded_forward
    run = Run()
    engine.add_request("first", *reqs["first"])
    while engine.num_continued_steps < 2:
        step(engine, run)
    engine.add_request("long", *reqs["long"])
    while engine.has_unfinished():
        step(engine, run)
    assert len(scheduled) == 1 and len(chunked) >= 2  # 45 tokens beside 5 rows: 4 chunks
    assert [c for c in chunk_contexts if c] == chunk_ends and chunk_ends[-1] >= 44
    run.check_streams()
    for rid in reqs:
        assert choices(run.final[rid]) == choices(want.final[rid]), rid
    assert engine.kv_pool_free() == all_free(engine) and not engine.scheduler.has_work()


def test_abort_while_a_step_is_in_flight(engine):
    """Aborting a request whose next step is already queued returns its pages at once.

    The queued step's tokens for it are dropped, and the other request goes on unchanged."""
    ref = solo(engine, prompt_of(20, 61), greedy(16))[0]
    engine.add_request("fly-a", prompt_of(20, 61), greedy(16))
    engine.add_request("fly-b", prompt_of(9, 62), greedy(16))
    run = Run()
    while engine._inflight is None or engine.num_continued_steps == 0:
        step(engine, run)
    abort_and_check(engine, run, "fly-b")
    while engine.has_unfinished():
        step(engine, run)
    run.check_streams()
    assert choices(run.final["fly-a"]) == choices(ref)
    assert engine.kv_pool_free() == all_free(engine)


# ---- adaptive draft length ----------------------------------------------------------------------


def full_length_cost(decode, verify, draft):
    """A bucket's step costs with the full draft length (4) only."""
    return StepCost(decode, {4: verify}, {4: draft})


def launch_steps(dl: DraftLength, batch_size: int, steps: int) -> list[int]:
    """The draft lengths of `steps` steps launched one after another, as the engine counts them."""
    lengths = []
    for _ in range(steps):
        lengths.append(dl.choose(batch_size))
        dl.launched(lengths[-1])
    return lengths


@pytest.mark.parametrize(
    "model,eager_from",
    [
        ("gemma-4-31B-it", 1024),
        ("gemma-4-26B-A4B-it", None),
        ("gemma-4-E4B-it", None),
        ("gemma-4-E2B-it", None),
    ],
)
def test_long_steps_alone_leave_their_graphs_for_the_long_prefix_tiles(model, eager_from):
    """A step whose chunks reach 8192 positions takes other full-layer tiles from 1024 rows, but
    runs eagerly (where its context can pick them) only where its layers' matmuls outlast the
    host's launch: at the default budget of 2048 rows, the 31B (58.6 GFLOP a row) from 1024
    rows, the other models never; and only where its longest group takes the 128-row tiles."""
    cfg = load_config(f"configs/{model}")
    with torch.device("meta"):
        flops = matmul_flops_per_row(Gemma4Model(cfg))
    if model == "gemma-4-31B-it":
        assert flops == pytest.approx(58.6e9, rel=1e-3)
    eager = [T for T in range(1, 2049) if leaves_graph_for_context(cfg, flops, T, T, LONG_PREFIX)]
    assert (eager[0] if eager else None) == eager_from
    assert 2048 not in eager  # the 31B's 2048 rows take the 128-row tiles without a prefix
    if eager:  # groups too short for the 128-row tiles (verifications and a short tail) keep them
        assert not leaves_graph_for_context(cfg, flops, 1100, 15, LONG_PREFIX)
        assert leaves_graph_for_context(cfg, flops, 1100, 16, LONG_PREFIX)


def test_draft_length_policy():
    costs = {1: full_length_cost(10.0, 11.0, 2.0), 8: full_length_cost(12.0, 30.0, 6.0)}
    dl = DraftLength(4, costs)
    assert dl.expected_tokens() == 5.0  # untried: assume every draft is accepted
    assert dl.choose(1) == 4 and dl.choose(8) == 4  # 5 x 12 > 30 + 6
    assert dl.choose(9) == 4  # beyond the measured buckets: keep drafting
    for _ in range(400):
        dl.observe(4, 1)  # the first draft accepted, the rest rejected
    assert dl.rates[0] == pytest.approx(1.0) and dl.rates[1] == pytest.approx(0.0, abs=1e-3)
    assert dl.choose(1) == 4  # 2 x 10 > 13
    assert dl.choose(5) == 0  # bucket 8: 2 x 12 < 36
    for _ in range(400):
        dl.observe(4, 0)
    assert dl.choose(1) == 0  # nothing accepted: 1 x 10 < 13
    probes = launch_steps(dl, 1, 2 * dl.probe_every)
    # but now and then it proposes all four and verifies them, to see whether acceptance came back
    assert probes.count(4) == 2 and probes.index(4) == dl.probe_every
    for _ in range(400):
        dl.observe(4, 4)
    assert dl.choose(8) == 4
    assert (
        DraftLength(4).choose(64) == 4 and DraftLength(0, costs).choose(1) == 0
    )  # no costs: k stays fixed


def test_draft_length_chooses_among_lengths():
    """With a shorter length measured too, the one with the most tokens per second wins: the later
    drafts' rows are worth their cost only while they are accepted."""
    assert draft_choices(4) == [2, 4] and draft_choices(3) == [2, 3] and draft_choices(1) == [1]
    costs = {32: StepCost(17.4, {2: 19.3, 4: 20.6}, {2: 0.9, 4: 1.7})}
    dl = DraftLength(4, costs, probe_every=8)
    assert dl.choose(32) == 4  # every draft accepted: 5 / 22.3 > 3 / 20.2 > 1 / 17.4
    for _ in range(400):
        dl.observe(4, 2)  # two accepted, the third and fourth never: 3 tokens either way
    assert dl.expected_tokens(2) == pytest.approx(3.0)
    assert dl.expected_tokens() == pytest.approx(3.0, abs=1e-3)
    assert dl.choose(32) == dl.choose(32) == 2  # asking is not a step
    picks = launch_steps(dl, 32, 16)
    # After 8 steps of 2, a probe: one step proposes all four, the next verifies them.
    assert picks == [2] * 8 + [4, 4] + [2] * 6
    for _ in range(400):
        dl.observe(4, 0)
    assert dl.choose(32) == 0  # nothing accepted: one token per decode step is cheapest


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_adaptive_draft_length_is_lossless(tiny_checkpoints, async_scheduling):
    """The full draft length for a lone sequence, the shorter one for 2-4 and none for more (the
    step costs say so) is lossless.

    It switches every way as requests come and go: the same tokens as without a drafter, and pages
    all back."""
    kw = dict(
        kv_cache_tokens=4096,
        page_size=4,
        max_num_batched_tokens=96,
        max_num_seqs=8,
        max_model_len=256,
        async_scheduling=async_scheduling,
    )
    eng = LLMEngine(engine_args(tiny_checkpoints, **kw))
    args = engine_args(tiny_checkpoints, **kw)
    args.draft, args.num_draft_tokens = None, 0
    plain = LLMEngine(args)
    assert draft_choices(K) == [2, 3]
    eng.draft_length = DraftLength(
        K,
        {
            1: StepCost(1.0, {2: 1.0, 3: 1.0}, {2: 0.1, 3: 0.1}),
            4: StepCost(1.0, {2: 1.2, 3: 9.0}, {2: 0.2, 3: 1.0}),
            8: StepCost(1.0, {2: 9.0, 3: 9.0}, {2: 1.0, 3: 1.0}),
        },
    )
    steps = []
    reqs = {
        f"adapt-{i}": (prompt_of(6 + 5 * i, 70 + i), greedy(60 if i == 0 else 8 + 6 * i))
        for i in range(6)
    }

    def on_step(run, outs):
        stats = eng.snapshot()
        steps.append((len(eng.scheduler.running), stats.draft_length, stats.spec_num_steps))

    got = run_requests(eng, reqs, on_step)
    want = run_requests(plain, reqs)
    for rid in reqs:
        assert choices(got.final[rid]) == choices(want.final[rid]), rid
    lengths = {n: {length for m, length, _ in steps if m == n} for n in range(1, 7)}
    assert 3 in lengths[1] and 2 in set().union(*(lengths[n] for n in (2, 3, 4)))
    grew_batched = [b - a for (n, _, a), (_, _, b) in zip(steps, steps[1:]) if n >= 5]
    assert sum(grew_batched) == 0
    stats = eng.snapshot()  # both lengths verified: 2 or 3 drafts per sequence step
    assert 2 * stats.spec_num_steps < stats.spec_drafted_tokens < 3 * stats.spec_num_steps
    assert eng.kv_pool_free() == all_free(eng)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_draft_length_probes_verify_the_full_length(tiny_checkpoints, async_scheduling):
    """While the shorter length wins, the periodic probes still get the later drafts verified (their
    acceptance rate is measured again), and the tokens stay those of decoding without a drafter."""
    kw = dict(
        kv_cache_tokens=1024, page_size=4, max_model_len=256, async_scheduling=async_scheduling
    )
    eng = LLMEngine(engine_args(tiny_checkpoints, **kw))
    args = engine_args(tiny_checkpoints, **kw)
    args.draft, args.num_draft_tokens = None, 0
    plain = LLMEngine(args)
    # 2 drafts always win, even if all 3 were accepted: 3 / 1.1 > 4 / 2.1 tokens per unit.
    costs = {1: StepCost(1.0, {2: 1.0, 3: 2.0}, {2: 0.1, 3: 0.1})}
    eng.draft_length = DraftLength(K, costs, probe_every=8)
    scheduled = []
    launch = eng.runner.launch
    eng.runner.launch = lambda *a: scheduled.append(1) or launch(*a)
    reqs = {"probe": (prompt_of(9, 80), greedy(120))}
    assert choices(run_requests(eng, reqs).final["probe"]) == choices(
        run_requests(plain, reqs).final["probe"]
    )
    stats = eng.snapshot()
    assert stats.spec_drafted_tokens > 2 * stats.spec_num_steps  # some steps verified 3 drafts
    assert eng.draft_length.rates[K - 1] < 1.0  # the third position's rate was observed
    if async_scheduling:  # the switches to and from the probes go on on the device
        assert len(scheduled) == 1 and eng.num_continued_steps > 10
    assert eng.kv_pool_free() == all_free(eng)


# ---- input validation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_tokens=0), "max_tokens must be at least 1"),
        (dict(temperature=-0.5), "temperature must be non-negative"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p must be in"),
        (dict(top_p=1.5), "top_p must be in"),
        (dict(min_p=1.5), "min_p must be in"),
        (dict(presence_penalty=3.0), "presence_penalty"),
        (dict(frequency_penalty=-2.5), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty must be positive"),
        (dict(logprobs=-1), "logprobs must be non-negative"),
        (dict(top_p=1e-50), "top_p must be 0 or of magnitude"),
        (dict(repetition_penalty=5e-324), "repetition_penalty must be 0 or of magnitude"),
        (dict(n=0), "n must be at least 1"),
        (dict(allowed_token_ids=[]), "allowed_token_ids must not be empty"),
        (dict(min_tokens=5, max_tokens=4), "min_tokens must be at most max_tokens"),
        (dict(bad_words=[" "]), "bad_words must not hold empty words"),
    ],
)
def test_bad_sampling_values(engine, kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
    # Fields changed after construction are checked again when the request is added.
    params = SamplingParams()
    for k, v in kwargs.items():
        setattr(params, k, v)
    with pytest.raises(ValueError, match=message):
        engine.add_request(f"bad-{next(_ids)}", [5, 6, 7], params)
    assert not engine.has_unfinished() and engine.kv_pool_free() == all_free(engine)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(logprobs=10**6), "logprobs must be at most the vocabulary size"),
        (dict(logit_bias={10**6: 1.0}), "logit_bias holds token ids outside"),
        (dict(allowed_token_ids=[-1]), "allowed_token_ids holds token ids outside"),
    ],
)
def test_token_ids_of_sampling_values_are_checked_against_the_vocabulary(engine, kwargs, message):
    with pytest.raises(ValueError, match=message):
        engine.add_request(f"bad-{next(_ids)}", [5, 6, 7], SamplingParams(**kwargs))
    assert not engine.has_unfinished() and engine.kv_pool_free() == all_free(engine)


@pytest.mark.parametrize(
    "prompt, max_tokens, message",
    [
        ([], 4, "prompt is empty"),
        ("", 4, "prompt is empty"),
        ([5] * 1024, 4, "maximum context length is 1024 tokens. However, your request has 1024 "),
        (
            [5] * 2000,
            None,
            "maximum context length is 1024 tokens. However, your request has 2000 ",
        ),
        ([5] * 1000, 100, r"requested 1100 tokens \(1000 in the input, 100 in the completion\)"),
        ([5, VOCAB, 6], 4, f"token id {VOCAB} is outside the vocabulary"),
        ([5, -1], 4, "token id -1 is outside the vocabulary"),
        ([5] * 10, 400, "KV cache"),  # fits max_model_len (1024) but not the 256-token pool
        ([5] * 10, None, "KV cache"),
    ],
)
def test_bad_prompts(engine, prompt, max_tokens, message):
    with pytest.raises(ValueError, match=message):
        engine.add_request(f"bad-{next(_ids)}", prompt, SamplingParams(max_tokens=max_tokens))
    assert not engine.has_unfinished() and not engine.scheduler.has_work()
    assert engine.kv_pool_free() == all_free(engine)


def test_duplicate_request_id(engine):
    engine.add_request("dup", [5, 6], greedy(2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", [7, 8], greedy(2))
    run = Run()
    while engine.has_unfinished():
        step(engine, run)
    assert run.final["dup"].prompt_token_ids == [5, 6]  # the first request is untouched
    assert engine.kv_pool_free() == all_free(engine)


# ---- the engine behind its socket (the engine loop on a thread: the --no-engine-process path) ---


def test_engine_client_concurrent_consumers(tiny_checkpoints, engine):
    prompts = [prompt_of(n, 900 + n) for n in (4, 17, 40, 75)]
    params = greedy(6)
    expected = [solo(engine, p, params)[0].token_ids for p in prompts]  # same config, run alone
    client = EngineProcessClient(engine_args(tiny_checkpoints, **MAIN), in_process=True)
    initial = all_free(engine)

    async def consume(i):
        streamed, final = [], None
        async for out in client.generate(prompts[i], params, f"async-{i}"):
            streamed += out.outputs[0].new_token_ids
            final = out
        return streamed, final

    async def quitter():
        # Long enough that it cannot finish on its own before the test ends.
        async for out in client.generate(prompt_of(8, 1), greedy(200), "quitter"):
            assert not out.finished
            break  # leaving the loop closes the generator, which aborts the request

    async def bad():
        with pytest.raises(ValueError, match="prompt is empty"):
            async for _ in client.generate([], params, "bad"):
                pass

    async def main():
        client.start()
        consumers = asyncio.gather(*(consume(i) for i in range(len(prompts))), quitter(), bad())
        results = await asyncio.wait_for(consumers, 120)
        # The quitter's abort reaches the engine asynchronously: wait for the pages to return.
        for _ in range(200):
            stats = client.stats()
            if stats.num_running + stats.num_waiting == 0 and stats.kv_pages_free == initial:
                break
            await asyncio.sleep(0.05)
        # shutdown() blocks; the event loop must keep running meanwhile.
        await asyncio.wait_for(asyncio.to_thread(client.shutdown, 5), 30)
        return results

    results = asyncio.run(main())
    for (streamed, final), want in zip(results, expected):
        assert final.finished and final.token_ids == streamed == want
    stats = client.stats()
    assert stats.num_running + stats.num_waiting == 0
    assert stats.kv_pages_free == initial
    # The quitter was aborted, not run to its length: only the full consumers finished.
    assert stats.requests_finished.get("length") == len(prompts)
    assert not client.ready and not client.dead
    # Its zmq context is ended by shutdown: one left to the garbage collector could hang in term().
    assert client._context.closed


def test_generation_config_supplies_the_default_sampling_settings(tiny_checkpoints):
    """generation_config supplies the sampling settings of a request that says nothing.

    The IT checkpoints' generation_config (temperature 1.0, top_k 64, top_p 0.95) is what a request
    that says nothing samples with, as in vLLM; fields the file does not set stay unset."""
    from gemma4serve.engine.engine import generation_defaults

    assert generation_defaults(tiny_checkpoints.get("dense")) == {
        "temperature": 1.0,
        "top_k": 64,
        "top_p": 0.95,
    }


def test_text_prompts_start_with_bos(tiny_checkpoints):
    """A raw text prompt gets Gemma's <bos> first, once, as vLLM's LLM.generate does."""
    llm = LLM(str(tiny_checkpoints.get("dense")), device="cpu")
    out = llm.generate(["Hello world"], SamplingParams(max_tokens=1, temperature=0.0))[0]
    assert out.prompt_token_ids[0] == 2 and out.prompt_token_ids[1] != 2
    again = llm.generate(["<bos>Hello world"], SamplingParams(max_tokens=1, temperature=0.0))[0]
    assert again.prompt_token_ids == out.prompt_token_ids


def test_attention_backend_choice_on_cpu():
    """auto is the torch reference off CUDA and Triton on CUDA, FlashInfer installed or not.

    FlashInfer (an optional extra, CUDA only) is refused with a clear error, never half-used."""
    from gemma4serve.attention.torch_backend import TorchAttention
    from gemma4serve.attention.triton_backend import TritonAttention
    from gemma4serve.config import ConfigError
    from gemma4serve.engine.models import make_attention_backend

    assert isinstance(make_attention_backend("auto", torch.device("cpu")), TorchAttention)
    # (built without touching a GPU: the kernels compile at their first launch)
    assert type(make_attention_backend("auto", torch.device("cuda"))) is TritonAttention
    with pytest.raises(ConfigError, match="flashinfer"):
        make_attention_backend("flashinfer", torch.device("cpu"))


def test_finished_requests_are_counted_once_whatever_n(engine):
    """request_success_total counts requests: a request of 3 choices is one, by its reason."""
    before = dict(engine.stats.requests_finished)
    solo(engine, prompt_of(5, 901), greedy(4, n=3))
    run = Run()
    engine.add_request("counted-abort", prompt_of(5, 902), greedy(40, n=2))
    step(engine, run)
    engine.abort("counted-abort")
    after = engine.stats.requests_finished
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert {k: v for k, v in delta.items() if v} == {"length": 1, "abort": 1}


def test_iteration_tokens_count_the_rows_each_step_ran(tiny_checkpoints):
    """The step-size histogram (/metrics' iteration_tokens_total) holds, for every forward the
    runner ran, its rows: prompt chunks beside decodes and verifications, scheduled and continued
    steps alike."""
    args = engine_args(
        tiny_checkpoints, forced_acceptance=float(K + 1), page_size=4, max_num_batched_tokens=16
    )
    engine = LLMEngine(args)
    rows, forward = [], engine.runner.forward

    def counted(batch, **kw):
        rows.append(batch.token_ids.shape[0])
        return forward(batch, **kw)

    engine.runner.forward = counted
    run = Run()
    engine.add_request("first", prompt_of(9, 75), greedy(30))
    while engine.num_continued_steps < 2:
        step(engine, run)
    engine.add_request("long", prompt_of(45, 76), greedy(10))
    while engine.has_unfinished():
        step(engine, run)
    run.check_streams()
    stats = engine.snapshot()
    assert engine.num_continued_steps > 5 and max(rows) == 16 and min(rows) < 16
    assert stats.iteration_tokens_sum == sum(rows)
    edges = (0, *ITERATION_TOKEN_BUCKETS, float("inf"))
    want = [sum(1 for r in rows if lower < r <= upper) for lower, upper in zip(edges, edges[1:])]
    assert stats.iteration_tokens_counts == want
