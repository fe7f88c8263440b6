"""The synchronous engine: requests in, one step at a time, outputs (with deltas) out.

It owns the request state machine (waiting -> prefill chunks -> decode/verify -> finished | aborted), the
stop conditions and detokenization; the scheduler decides what runs, the runner runs it.
"""

from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from gemma4serve.detokenizer import IncrementalDetokenizer
from gemma4serve.engine.args import EngineArgs
from gemma4serve.engine.cuda_graphs import CudaGraphs
from gemma4serve.engine.models import load_models
from gemma4serve.engine.outputs import (
    CompletionOutput,
    EngineStats,
    RequestMetrics,
    RequestOutput,
    TokenLogprob,
)
from gemma4serve.engine.runner import ModelRunner, StepHandle
from gemma4serve.engine.scheduler import Scheduler
from gemma4serve.engine.sequence import ScheduledChunk, Sequence, Status, StepResult
from gemma4serve.engine.spec import DraftLength, ForcedAcceptance
from gemma4serve.kv.manager import KVManager
from gemma4serve.kv.pool import PagePool
from gemma4serve.sampling_params import SamplingParams
from gemma4serve.tokenizer import Tokenizer

log = logging.getLogger("gemma4serve")

_SEED_STRIDE = 0x9E3779B97F4A7C15  # choices of one request get well-separated seeds


# generation_config.json fields that become the server's sampling defaults (vLLM's behaviour): the IT
# checkpoints ship temperature 1.0, top_k 64, top_p 0.95.
_GENERATION_DEFAULTS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")


def generation_defaults(checkpoint_dir: Path) -> dict:
    path = checkpoint_dir / "generation_config.json"
    if not path.exists():
        return {}
    gen = json.loads(path.read_text())
    return {k: gen[k] for k in _GENERATION_DEFAULTS if gen.get(k) is not None}


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detoks: list
    metrics: RequestMetrics
    new_ids: list = field(default_factory=list)  # per choice: tokens since the last output
    new_text: list = field(default_factory=list)
    new_logprobs: list = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(s.status is Status.FINISHED for s in self.seqs)


class LLMEngine:
    def __init__(self, args: EngineArgs):
        self.args = args
        self.state = load_models(args)
        cfg = self.state.target.cfg
        self.cfg = cfg
        tok_dir = Path(args.tokenizer) if args.tokenizer else self.state.target_dir
        self.tokenizer = (
            Tokenizer.from_dir(tok_dir) if (tok_dir / "tokenizer.json").exists() else None
        )
        self.eos_ids = set(cfg.eos_token_ids)
        self.default_sampling_params = generation_defaults(self.state.target_dir)
        plan = self.state.kv_plan
        self.max_model_len = plan.max_model_len
        ps = args.page_size
        self.kv = KVManager(
            PagePool(plan.full_pages, ps, "full"),
            PagePool(plan.sliding_pages, ps, "sliding"),
            ps,
            plan.sliding_keep,
        )
        self.scheduler = Scheduler(self.kv, args.max_num_seqs, args.max_num_batched_tokens)
        forced = None
        k = args.num_draft_tokens if self.state.draft is not None else 0
        if args.forced_acceptance is not None and k:
            forced = ForcedAcceptance(args.forced_acceptance, k, self.state.device)
            log.warning(
                "BENCHMARK MODE: --forced-acceptance forces %.2f tokens per verify step; generated text is NOT "
                "the model's output",
                forced.mean_tokens_per_step,
            )
        self.num_draft_tokens = k
        graphs, costs = None, None
        if (
            self.state.device.type == "cuda"
            and not args.enforce_eager
            and self.state.attn.name != "torch"
        ):
            graphs = CudaGraphs(self.state, args.max_num_seqs, self.max_model_len, k)
            graphs.capture()
            costs = graphs.measure() if args.adaptive_draft_length else None
            if costs:
                log.info(
                    "step costs per batch bucket (decode / verify / draft loop ms): %s",
                    "; ".join(
                        f"{b}: {c.decode * 1e3:.2f} / {c.verify * 1e3:.2f} / {c.draft * 1e3:.2f}"
                        for b, c in costs.items()
                    ),
                )
        self.draft_length = DraftLength(k, costs)
        self.runner = ModelRunner(self.state, k, forced, graphs)
        if self.state.device.type == "cuda":
            self._warm_up()
        self.requests: dict[str, Request] = {}
        self._rng = random.Random(args.seed)
        self._arrivals = 0
        self.stats = EngineStats(spec_accepted_per_position=[0] * k)
        self._inflight: StepHandle | None = (
            None  # a launched decode step not read yet (async scheduling)
        )
        self.num_continued_steps = (
            0  # steps queued before the results of the step before them were read
        )

    def _warm_up(self) -> None:
        """One eager step per chunk length before serving, so that Triton compiles the kernel variants that eager
        steps select by shape now, not while requests wait (up to seconds per prompt on a cold cache;
        docs/performance.md, compile stalls), and one greedy step for the greedy heads' kernels. Its pages are
        freed again."""
        t0 = time.monotonic()
        limit = min(self.args.max_num_batched_tokens, self.max_model_len - 1)
        longest = limit // 16 * 16
        # Kernels pick tiles by power-of-two buckets of the rows (attention by the longest query run, the GEMV up
        # to 16 rows, MoE by token-expert pairs), and Triton specialises integers that are 1 or divisible by 16:
        # each power of two, one past it, and the longest chunks reach every bucket.
        lengths = {1, longest - 1, longest} | {
            n for j in range(1, limit.bit_length()) for n in (2**j, 2**j + 1)
        }
        sampled, greedy = (
            SamplingParams(max_tokens=1),
            SamplingParams(max_tokens=1, temperature=0.0),
        )
        for n, params in [(n, sampled) for n in sorted(lengths) if 1 <= n <= limit] + [(1, greedy)]:
            seq = Sequence("warm-up", 0, [0] * n, n, params, 0, 0, n + 1)
            self.kv.grow(seq.pages, 0, n)
            try:
                self.runner.launch([ScheduledChunk(seq, 0, n, [])], self.num_draft_tokens).results()
            finally:
                self.kv.free(seq.pages)
        log.info("warmed up eager steps in %.1fs", time.monotonic() - t0)

    # ---- requests -------------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: list[int] | str, params: SamplingParams) -> None:
        """Queue a request; raises ValueError with a user-facing message when it cannot be served."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass token ids")
            ids = self.tokenizer.encode(prompt)
            bos = self.tokenizer.bos_token_id
            # Gemma expects <bos> first (the chat template writes it; a raw text prompt gets it here, as in vLLM).
            prompt = ids if (not ids or bos is None or ids[:1] == [bos]) else [bos] + ids
        prompt = [int(t) for t in prompt]
        params.validate()
        if not prompt:
            raise ValueError("the prompt is empty")
        bad = [t for t in prompt if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(
                f"token id {bad[0]} is outside the vocabulary (0..{self.cfg.vocab_size - 1})"
            )
        n_prompt = len(prompt)
        if n_prompt >= self.max_model_len:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has {n_prompt}"
            )
        if params.max_tokens is not None and n_prompt + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens; the request asks for "
                f"{n_prompt} prompt tokens + {params.max_tokens} max_tokens"
            )
        max_len = min(self.max_model_len, n_prompt + (params.max_tokens or self.max_model_len))
        if self.kv.pages_for(max_len + self.num_draft_tokens + 1) > self.kv.full.capacity:
            raise ValueError(
                f"the request needs up to {max_len} tokens of KV cache; the pool holds "
                f"{self.kv.full.capacity * self.kv.page_size}"
            )
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        seqs, detoks = [], []
        for i in range(params.n):
            self._arrivals += 1
            seqs.append(
                Sequence(
                    request_id=request_id,
                    index=i,
                    token_ids=list(prompt),
                    num_prompt=n_prompt,
                    params=params,
                    seed=(base_seed + i * _SEED_STRIDE) % (1 << 64),
                    arrival=self._arrivals,
                    max_len=max_len,
                )
            )
            detoks.append(
                IncrementalDetokenizer(
                    self.tokenizer,
                    skip_special_tokens=params.skip_special_tokens,
                    stop=params.stop,
                    include_stop_str_in_output=params.include_stop_str_in_output,
                )
                if self.tokenizer is not None
                else None
            )
        req = Request(
            request_id,
            prompt,
            params,
            seqs,
            detoks,
            RequestMetrics(arrival_time=time.monotonic()),
            new_ids=[[] for _ in seqs],
            new_text=["" for _ in seqs],
            new_logprobs=[[] for _ in seqs],
        )
        self.requests[request_id] = req
        self.stats.prompt_tokens += n_prompt
        for s in seqs:
            self.scheduler.add(s)

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        for s in req.seqs:
            if s.status is not Status.FINISHED:
                s.finish_reason = "abort"
                self.scheduler.finish(s)
                self.stats.requests_finished["abort"] = (
                    self.stats.requests_finished.get("abort", 0) + 1
                )
        return self._output(req)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- the step -------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step. With async scheduling a pure decode step is read one call later: the call first
        queues the step that follows it on the device, then reads and commits it while the GPU runs on."""
        prev = self._inflight
        if prev is not None:
            self._inflight = self._continue(prev)
            outs = self._finish_step(prev)
            if self._inflight is not None and all(
                s.status is Status.FINISHED for s in self._inflight.seqs
            ):
                self._inflight = None  # everything it computes was cut off by `prev`
            return outs
        chunks = self.scheduler.schedule()
        self.stats.num_preemptions = self.scheduler.num_preemptions
        if not chunks:
            return []
        now = time.monotonic()
        for ch in chunks:
            m = self.requests[ch.seq.request_id].metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = now
        draft_len = self.stats.draft_length = self.draft_length.choose(
            sum(ch.samples for ch in chunks)
        )
        if not draft_len:
            for ch in chunks:
                ch.drafts = []
        handle = self.runner.launch(chunks, draft_len)
        for ch in chunks:
            if not ch.samples:
                ch.seq.num_computed += ch.length
        if handle.continuable and self.args.async_scheduling:
            self._inflight = handle
            return []
        return self._finish_step(handle)

    def _continue(self, prev: StepHandle) -> StepHandle | None:
        """Queue the step after `prev` (same sequences, one more verify each, as many drafts) if the scheduler
        would pick exactly that and its KV fits; None otherwise."""
        seqs, sch = prev.seqs, self.scheduler
        q_prev, q_next = prev.tokens.shape[1], prev.draft_len + 1
        budget = sch.max_num_batched_tokens - len(seqs) * q_next
        if sch.running != seqs or budget < 0 or sch.would_admit(budget):
            return None
        if (
            any(s.status is not Status.RUNNING for s in seqs)
            or self.draft_length.choose(len(seqs)) != prev.draft_len
        ):
            return None
        # `prev` may emit q_prev tokens, then the next step writes q_next rows (past a sequence's end too: the
        # rows of a sequence that ends in `prev` are dropped).
        if not self.kv.grow_all(
            [(s.pages, s.num_computed, s.num_computed + q_prev + q_next) for s in seqs]
        ):
            return None
        self.num_continued_steps += 1
        return self.runner.launch_next(prev, [s.pages for s in seqs])

    def _finish_step(self, handle: StepHandle) -> list[RequestOutput]:
        touched: dict[str, Request] = {}
        for (seq, result), drafted in zip(handle.results().items(), handle.drafted):
            if (
                seq.status is Status.FINISHED
            ):  # aborted, or cut off by the step before (async scheduling)
                continue
            req = self.requests[seq.request_id]
            self._commit(req, seq, drafted, result)
            touched[req.request_id] = req
        outs = []
        for req in touched.values():
            outs.append(self._output(req))
            if req.finished:
                del self.requests[req.request_id]
        return outs

    def _commit(self, req: Request, seq: Sequence, drafted: int, result: StepResult) -> None:
        """Append the step's tokens, cutting at the first stop condition, and record drafting statistics."""
        st = self.stats
        st.seq_steps += 1
        if drafted:
            accepted = len(result.tokens) - 1
            self.draft_length.observe(drafted, accepted)
            st.spec_num_steps += 1
            st.spec_drafted_tokens += drafted
            st.spec_accepted_tokens += accepted
            for i in range(accepted):
                st.spec_accepted_per_position[i] += 1
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = time.monotonic()
        p, i = seq.params, seq.index
        detok = req.detoks[i]
        for j, tok in enumerate(result.tokens):
            seq.token_ids.append(tok)
            req.new_ids[i].append(tok)
            st.generation_tokens += 1
            if result.logprobs is not None:
                lp, top = result.logprobs[j]
                req.new_logprobs[i].append(TokenLogprob(tok, lp, top))
            if not p.ignore_eos and tok in self.eos_ids:
                self._finish(req, seq, "stop", tok)
                break
            if tok in p.stop_token_ids:
                if (
                    detok is not None and p.include_stop_str_in_output
                ):  # vLLM shows the stop token's text then
                    req.new_text[i] += detok.push([tok])[0]
                self._finish(req, seq, "stop", tok)
                break
            if detok is not None:
                text, stop = detok.push([tok])
                req.new_text[i] += text
                if stop is not None:
                    self._finish(req, seq, "stop", stop)
                    break
            if seq.num_tokens >= seq.max_len:
                self._finish(req, seq, "length", None)
                break
        if seq.status is not Status.FINISHED:
            seq.num_computed = seq.num_tokens - 1
            seq.drafts = result.next_drafts

    def _finish(self, req: Request, seq: Sequence, reason: str, stop_reason) -> None:
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        detok = req.detoks[seq.index]
        if detok is not None:
            req.new_text[seq.index] += detok.flush()
        self.scheduler.finish(seq)
        self.stats.requests_finished[reason] = self.stats.requests_finished.get(reason, 0) + 1

    def _output(self, req: Request) -> RequestOutput:
        outs = []
        for i, seq in enumerate(req.seqs):
            detok = req.detoks[i]
            outs.append(
                CompletionOutput(
                    index=i,
                    text=detok.text if detok is not None else "",
                    token_ids=list(seq.output_ids),
                    new_text=req.new_text[i],
                    new_token_ids=req.new_ids[i],
                    new_logprobs=req.new_logprobs[i] if req.params.logprobs is not None else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
            req.new_ids[i], req.new_text[i], req.new_logprobs[i] = [], "", []
        finished = req.finished
        if finished:
            req.metrics.finished_time = time.monotonic()
        return RequestOutput(req.request_id, req.prompt_ids, outs, finished, req.metrics)

    # ---- introspection --------------------------------------------------------------------------------

    def snapshot(self) -> EngineStats:
        st = self.stats
        st.num_running = len(self.scheduler.running)
        st.num_waiting = len(self.scheduler.waiting)
        st.full_pages_total, st.full_pages_free = self.kv.full.capacity, self.kv.full.num_free
        st.swa_pages_total, st.swa_pages_free = self.kv.sliding.capacity, self.kv.sliding.num_free
        st.num_preemptions = self.scheduler.num_preemptions
        return EngineStats(
            **{
                **st.__dict__,
                "requests_finished": dict(st.requests_finished),
                "spec_accepted_per_position": list(st.spec_accepted_per_position),
            }
        )

    def kv_pool_free(self) -> dict:
        return {"full": self.kv.full.num_free, "sliding": self.kv.sliding.num_free}
