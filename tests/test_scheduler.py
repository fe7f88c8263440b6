"""The scheduler alone (no model): admission against the pages sequences are expected to draw.

A step here does what the engine's does to the scheduler's state: prefill chunks advance, a
verify chunk commits its accepted drafts and one more token. Sequences run to their max_tokens
unless told to stop early.
"""

from __future__ import annotations

import itertools
import math

from gemma4serve.config import FULL, SLIDING
from gemma4serve.engine.scheduler import Scheduler
from gemma4serve.engine.sequence import Sequence
from gemma4serve.kv.manager import KVManager
from gemma4serve.kv.sizing import KVPlan
from gemma4serve.sampling_params import SamplingParams

PAGE_TOKENS = {FULL: 8, SLIDING: 4}
KEEP = 15  # a 16-token window
K = 3  # drafts per verify
PEAK_ROWS = KEEP + math.lcm(*PAGE_TOKENS.values()) + 2 * (K + 1)


def make_scheduler(num_pages: int) -> Scheduler:
    plan = KVPlan(num_pages, PAGE_TOKENS, 1, KEEP, 1024, peak_sliding_rows=PEAK_ROWS)
    return Scheduler(KVManager.for_plan(plan, "test"), 64, 96)


def run(scheduler: Scheduler, requests: list[tuple[int, int, int]], concurrency: int) -> dict:
    """Serve (prompt length, max_tokens, tokens it stops after) requests, `concurrency` at a time,
    accepting 2 drafts per verify; returns what happened."""
    ids = itertools.count()
    queue = list(requests)
    stop_after: dict[str, int] = {}

    def submit():
        prompt, max_tokens, stops = queue.pop(0)
        i = next(ids)
        seq = Sequence(
            str(i), 0, [(i * 31 + j) % 500 + 5 for j in range(prompt)], prompt,
            SamplingParams(max_tokens=max_tokens), 0, i, prompt + max_tokens,
        )  # fmt: skip
        stop_after[seq.request_id] = stops
        scheduler.add(seq)

    for _ in range(min(concurrency, len(queue))):
        submit()
    peak_running = finished = steps = 0
    while scheduler.has_work():
        steps += 1
        assert steps < 10_000, "stuck"
        chunks = scheduler.schedule()
        assert chunks, "nothing scheduled with work waiting"
        peak_running = max(peak_running, len(scheduler.running))
        for chunk in chunks:
            seq = chunk.seq
            if not chunk.samples:
                seq.num_computed += chunk.length
                continue
            accepted = min(2, len(chunk.drafts))
            seq.num_computed = chunk.start + chunk.length + accepted
            seq.token_ids += [7] * (accepted + 1)
            seq.drafts = [8] * K
            generated = seq.num_tokens - seq.num_prompt
            limit = min(seq.max_len - seq.num_prompt, stop_after[seq.request_id])
            if generated >= limit:
                del seq.token_ids[seq.num_prompt + limit :]
                seq.num_computed = seq.num_tokens - 1
                seq.finish_reason = "length" if limit == seq.max_len - seq.num_prompt else "stop"
                scheduler.finish(seq)
                finished += 1
                if queue:
                    submit()
    pool = scheduler.kv.pool
    assert pool.num_free == pool.capacity, "pages leaked"
    return dict(finished=finished, preemptions=scheduler.num_preemptions, peak_running=peak_running)


FULL_LENGTH = [(40 + 7 * (i % 5), 48, 48) for i in range(40)]  # every request to max_tokens


def test_admission_reserves_what_outputs_will_draw():
    """Requests that run to max_tokens in an arena too small for all of them at once: admissions
    wait for the pages the running ones will draw, so none is preempted (and none recomputed)."""
    done = run(make_scheduler(150), FULL_LENGTH, concurrency=16)
    assert done["finished"] == 40 and done["preemptions"] == 0
    assert 1 < done["peak_running"] < 16  # memory, not the clients, bounds the batch


def test_without_the_reservation_the_same_load_preempts():
    """The arena above is tight: admitting on the first chunk alone leads to preemptions."""
    scheduler = make_scheduler(150)
    scheduler.expected_end = lambda seq: seq.num_tokens
    done = run(scheduler, FULL_LENGTH, concurrency=16)
    assert done["finished"] == 40 and done["preemptions"] > 0


def test_reservation_follows_what_requests_use():
    """Requests that stop at a tenth of a large max_tokens: once some have finished, the expected
    output shrinks, and more run at once than if each reserved its max_tokens."""
    early = [(40, 480, 48)] * 40
    scheduler = make_scheduler(150)
    done = run(scheduler, early, concurrency=16)
    assert done["finished"] == 40 and done["preemptions"] == 0
    assert list(scheduler.output_shares) == [0.1] * 40
    pessimist = make_scheduler(150)
    pessimist.expected_end = lambda seq: seq.max_len
    assert done["peak_running"] > 2 * run(pessimist, early, concurrency=16)["peak_running"]


def test_sliding_pages_behind_every_reader_go_back_to_the_arena():
    """Growing a sequence a verify step at a time keeps exactly the sliding pages some reader can
    still reach (every entry below them 0, none of them 0), draws its full pages once, and `free`
    returns every page; with a prefix cache, a hit's sequence does the same from the hit on."""
    for model_key in (None, "test"):
        plan = KVPlan(400, PAGE_TOKENS, 1, KEEP, 1024, peak_sliding_rows=PEAK_ROWS)
        kv = KVManager.for_plan(plan, model_key)
        seqs = [
            Sequence(name, 0, list(range(10, 40)), 30, SamplingParams(), 0, i, 200)
            for i, name in enumerate("ab")
        ]
        hits = []
        for seq in seqs:
            hit = kv.lookup(seq)
            hits.append(hit)
            start = 0 if hit is None else hit.tokens
            if hit is not None:
                kv.adopt(seq, hit)
            kv.grow(seq, start, seq.num_tokens)
            for position in range(seq.num_tokens, seq.num_tokens + 150, K + 1):
                seq.token_ids.extend(range(K + 1))
                kv.grow(seq, position, position + K + 1)
                first = kv._first_sliding_page(position)
                live = seq.pages.sliding[first:]
                assert not any(seq.pages.sliding[:first]) and all(live), position
                assert len(seq.pages.full) == kv.pages_for(position + K + 1, FULL)
            kv.free(seq, seq.num_tokens)
        assert kv.pool.num_free == kv.pool.capacity
        # "b" (the same prompt) starts from "a"'s cached prefix where there is a cache
        assert hits[0] is None and (model_key is None) == (hits[1] is None)
