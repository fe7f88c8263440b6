"""The synchronous engine: requests in, one step at a time, outputs (with deltas) out.

It owns the request state machine (waiting -> prefill chunks -> decode/verify -> finished or
aborted) and the stop conditions seen in tokens; the scheduler decides what runs, the runner runs
it. Text and stop strings are the `OutputProcessor`'s: this engine's own (`detokenize`), or the
server's when the engine runs in a process of its own.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from gemma4serve.engine.args import GENERATION_DEFAULTS, EngineArgs
from gemma4serve.engine.attention_variants import compile_attention_variants
from gemma4serve.engine.cuda_graphs import capture_graphs
from gemma4serve.engine.models import check_tensor_parallel, load_models
from gemma4serve.engine.output_processor import OutputProcessor, StopChoice
from gemma4serve.engine.outputs import (
    CompletionOutput,
    EngineStats,
    RequestMetrics,
    RequestOutput,
    TokenLogprob,
)
from gemma4serve.engine.runner import ModelRunner
from gemma4serve.engine.sampler import TokenRules, needs_host_between_steps
from gemma4serve.engine.scheduler import Scheduler
from gemma4serve.engine.sequence import ScheduledChunk, Sequence, Status, StepResult
from gemma4serve.engine.spec import DraftLength, ForcedAcceptance
from gemma4serve.engine.step_data import StepHandle
from gemma4serve.kv.manager import KVManager
from gemma4serve.model.fused import gemv_max_rows
from gemma4serve.parallel.workers import TensorParallelWorkers
from gemma4serve.sampling_params import SamplingParams
from gemma4serve.structured.grammar import GrammarCompiler, GrammarState
from gemma4serve.tokenizer import Tokenizer
from gemma4serve.validation import (
    RequestError,
    check_context_length,
    check_token_ids,
    encode_text,
    with_bos,
)

log = logging.getLogger("gemma4serve")

_SEED_STRIDE = 0x9E3779B97F4A7C15  # choices of one request get well-separated seeds


# generation_config.json fields that become the server's sampling defaults (vLLM's behaviour): the
# IT checkpoints ship temperature 1.0, top_k 64, top_p 0.95.
def generation_defaults(checkpoint_dir: Path) -> dict:
    path = checkpoint_dir / "generation_config.json"
    if not path.exists():
        return {}
    gen = json.loads(path.read_text())
    return {k: gen[k] for k in GENERATION_DEFAULTS if gen.get(k) is not None}


@dataclass(eq=False)
class Choice:
    """One of a request's n choices: its sequence and what its next output adds."""

    sequence: Sequence
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprob] = field(default_factory=list)

    def take_output(self, with_logprobs: bool) -> CompletionOutput:
        """The choice as an output, with the tokens new since the last one (then cleared)."""
        seq = self.sequence
        output = CompletionOutput(
            index=seq.index,
            new_token_ids=self.new_token_ids,
            new_logprobs=self.new_logprobs if with_logprobs else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )
        self.new_token_ids, self.new_logprobs = [], []
        return output


@dataclass(eq=False)
class Request:
    request_id: str
    params: SamplingParams
    choices: list[Choice]
    metrics: RequestMetrics
    prompt_logprobs_sent: bool = False

    @property
    def sequences(self) -> list[Sequence]:
        return [choice.sequence for choice in self.choices]

    @property
    def finished(self) -> bool:
        return all(seq.status is Status.FINISHED for seq in self.sequences)


class LLMEngine:
    def __init__(self, args: EngineArgs, log_level: str | None = None):
        """`log_level`: the logging level of tensor-parallel worker processes (None: as they
        start, blank)."""
        self.args = args
        if args.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be at least 1")
        # Rank 0 of tensor parallelism: this engine schedules, the workers follow its plans.
        self.workers: TensorParallelWorkers | None = None
        if args.tensor_parallel_size > 1:
            check_tensor_parallel(args)
            self.workers = TensorParallelWorkers(args, log_level)
        try:
            self._start(args)
        except BaseException:
            self.shutdown()
            raise

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing to do on one device)."""
        if self.workers is not None:
            if hasattr(self, "runner"):  # the graphs go before the group (workers.leave_group)
                self.runner.graphs, self._inflight = None, None
            self.workers.stop()

    def _start(self, args: EngineArgs) -> None:
        tp = self.workers.tp if self.workers is not None else None
        self.state = load_models(args, tp)
        cfg = self.state.target.cfg
        self.cfg = cfg
        tokenizer_dir = Path(args.tokenizer) if args.tokenizer else self.state.target_dir
        has_tokenizer = (tokenizer_dir / "tokenizer.json").exists()
        self.tokenizer = Tokenizer.from_dir(tokenizer_dir) if has_tokenizer else None
        self.eos_ids = set(cfg.eos_token_ids)
        self._grammars: GrammarCompiler | None = None  # made by the first structured request
        self.default_sampling_params = (
            {}
            if args.generation_config == "vllm"
            else generation_defaults(
                self.state.target_dir
                if args.generation_config == "auto"
                else Path(args.generation_config)
            )
        ) | args.override_generation_config
        plan = self.state.kv_plan
        self.max_model_len = plan.max_model_len
        model_key = f"{self.state.target_dir.resolve()}|{self.state.dtype}|{args.load_format}"
        self.kv = KVManager.for_plan(plan, model_key if args.enable_prefix_caching else None)
        self.scheduler = Scheduler(self.kv, args.max_num_seqs, args.max_num_batched_tokens)
        k = args.num_draft_tokens if self.state.draft is not None else 0
        self.num_draft_tokens = k
        forced = ForcedAcceptance.from_args(args, k, self.state.device)
        if forced is not None:
            log.warning(
                "BENCHMARK MODE: --forced-acceptance forces %.2f tokens per verify step; "
                "generated text is NOT the model's output",
                forced.mean_tokens_per_step,
            )
        compile_attention_variants(self.state, args, k)  # every rank; its graphs then find them
        graphs, costs = capture_graphs(self.state, args, k)
        self.draft_length = DraftLength(k, costs)
        self.runner = ModelRunner(
            self.state,
            num_draft_tokens=k,
            forced=forced,
            graphs=graphs,
            followers=self.workers.plans if self.workers is not None else None,
        )
        if self.state.device.type == "cuda":
            self._warm_up()
        self.requests: dict[str, Request] = {}
        self._rng = random.Random(args.seed)
        self._arrivals = 0
        self.stats = EngineStats(spec_accepted_per_position=[0] * k)
        self._inflight: StepHandle | None = None  # a continued step not read yet
        self.num_continued_steps = 0  # steps queued before the step before them was read
        self.output_processor = OutputProcessor(self.tokenizer) if args.detokenize else None

    def _warm_up(self) -> None:
        """One step per chunk-length bucket (eager, or on the mixed graph that holds it), so Triton
        compiles the shape-selected kernel variants before serving rather than while requests
        wait, and one greedy step for the greedy heads' kernels (attention's variants:
        `compile_attention_variants`). Its pages are freed again."""
        t0 = time.monotonic()
        limit = min(self.args.max_num_batched_tokens, self.max_model_len - 1)
        longest = limit // 16 * 16
        # Kernels pick tiles by power-of-two buckets of rows, and Triton specialises integers that
        # are 1 or divisible by 16: each power of two, one past it, and the longest chunks.
        lengths = {1, longest - 1, longest} | {
            n for j in range(1, limit.bit_length()) for n in (2**j, 2**j + 1)
        }
        sampled = SamplingParams(max_tokens=1)
        greedy = SamplingParams(max_tokens=1, temperature=0.0)
        runs = [(n, sampled) for n in sorted(lengths) if 1 <= n <= limit] + [(1, greedy)]
        # Unaligned rows past the GEMV's, eager (prompt logprobs keep a step off the mixed graphs,
        # whose rows are 16-aligned): variants only such steps take (tensor parallelism's fused
        # all-reduce after cuBLAS rows).
        unaligned = gemv_max_rows() + 1
        if unaligned <= limit:
            runs.append((unaligned, SamplingParams(max_tokens=1, prompt_logprobs=0)))
        for n, params in runs:
            seq = Sequence(
                request_id="warm-up",
                index=0,
                token_ids=[0] * n,
                num_prompt=n,
                params=params,
                seed=0,
                arrival=0,
                max_len=n + 1,
                prompt_logprobs=[] if params.prompt_logprobs is not None else None,
            )
            self.kv.grow(seq, 0, n)
            try:
                chunk = ScheduledChunk(seq, 0, n, [])
                self.runner.launch([chunk], self.num_draft_tokens).results()
            finally:
                self.kv.free(seq, committed=0)
        log.info("warmed up eager steps in %.1fs", time.monotonic() - t0)

    # ---- requests -------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: list[int] | str,
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request; raises RequestError (a ValueError) when it cannot be served.
        `arrival_time`: its `time.monotonic()` on arrival (default: now); queue time, TTFT and
        latency count from it."""
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer: pass token ids")
            text = encode_text(self.tokenizer, prompt, param="prompt")
            prompt = with_bos(text, self.tokenizer.bos_token_id)
        prompt = [int(t) for t in prompt]
        params.validate()
        check_token_ids(prompt, self.cfg.vocab_size)
        max_tokens = check_context_length(len(prompt), params.max_tokens, self.max_model_len)
        max_len = len(prompt) + max_tokens
        capacity = self.state.kv_plan.sequence_capacity
        if max_len > capacity:
            raise RequestError(
                f"the request needs up to {max_len} tokens of KV cache; the cache holds "
                f"{capacity} for one sequence"
            )
        for name in ("logprobs", "prompt_logprobs"):
            wanted = getattr(params, name)
            if wanted is not None and wanted > self.cfg.vocab_size:
                raise RequestError(
                    f"{name} must be at most the vocabulary size ({self.cfg.vocab_size}), "
                    f"got {wanted}",
                    param=name,
                )
        token_rules = self._token_rules(params, len(prompt))
        grammars = [self._grammar(params) for _ in range(params.n)]
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        choices = []
        for i in range(params.n):
            self._arrivals += 1
            seq = Sequence(
                request_id=request_id,
                index=i,
                token_ids=list(prompt),
                num_prompt=len(prompt),
                params=params,
                seed=(base_seed + i * _SEED_STRIDE) % (1 << 64),
                arrival=self._arrivals,
                max_len=max_len,
                token_rules=token_rules,
                prompt_logprobs=[] if params.prompt_logprobs is not None and i == 0 else None,
                grammar=grammars[i],
            )
            choices.append(Choice(seq))
        arrival = time.monotonic() if arrival_time is None else arrival_time
        metrics = RequestMetrics(arrival_time=arrival)
        self.requests[request_id] = Request(request_id, params, choices, metrics)
        self.stats.prompt_tokens += len(prompt)
        for choice in choices:
            self.scheduler.add(choice.sequence)
        if self.output_processor is not None:
            self.output_processor.add_request(request_id, prompt, params)

    def _token_rules(self, params: SamplingParams, prompt_len: int) -> TokenRules | None:
        """The request's logit_bias, allowed_token_ids, bad_words and min_tokens as token ids;
        None when it has none (the sampler then skips them at no cost)."""
        if not params.has_token_rules:
            return None
        vocab = self.cfg.vocab_size
        for name, ids in (
            ("logit_bias", list(params.logit_bias or ())),
            ("allowed_token_ids", params.allowed_token_ids or []),
        ):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise RequestError(
                    f"{name} holds token ids outside the vocabulary [0, {vocab}): {bad[:5]}",
                    param=name,
                )
        bias = dict(params.logit_bias or {})
        sequences = []
        if params.bad_words:
            if self.tokenizer is None:
                raise RequestError("bad_words need a tokenizer", param="bad_words")
            # As vLLM: each word as written and after a space (how it appears mid-text).
            for word in params.bad_words:
                for text in (word.lstrip(), " " + word.lstrip()):
                    ids = self.tokenizer.encode(text, add_special_tokens=False)
                    if len(ids) == 1:
                        bias[ids[0]] = float("-inf")
                    elif ids and ids not in sequences:
                        sequences.append(ids)
        end_ids = list(params.stop_token_ids) + ([] if params.ignore_eos else sorted(self.eos_ids))
        return TokenRules(
            bias=bias,
            allowed=list(params.allowed_token_ids) if params.allowed_token_ids else None,
            bad_sequences=sequences,
            end_ids=end_ids if params.min_tokens else [],
            min_tokens_position=prompt_len + params.min_tokens,
        )

    def _grammar(self, params: SamplingParams) -> GrammarState | None:
        """A fresh matcher for a structured request's choice (RequestError on a bad schema)."""
        if params.structured_outputs is None:
            return None
        if self.tokenizer is None:
            raise RequestError("structured output needs a tokenizer; this model has none")
        if self._grammars is None:
            self._grammars = GrammarCompiler(
                self.tokenizer, self.cfg.vocab_size, sorted(self.eos_ids)
            )
        return self._grammars.matcher(params.structured_outputs)

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        for choice in req.choices:
            if choice.sequence.status is not Status.FINISHED:
                choice.sequence.finish_reason = "abort"
                self.scheduler.finish(choice.sequence)
        self._count_finished(req)
        outputs = self._processed([self._output(req)])
        return outputs[0] if outputs else None

    def stop_choice(self, stop: StopChoice) -> None:
        """Finish a choice that a stop string ended (the output processor found it)."""
        req = self.requests.get(stop.request_id)
        if req is None:
            return
        seq = req.choices[stop.index].sequence
        if seq.status is Status.FINISHED:
            return
        seq.finish_reason, seq.stop_reason = "stop", stop.stop
        self.scheduler.finish(seq)
        if req.finished:
            self._count_finished(req)
            del self.requests[stop.request_id]

    def _processed(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """The outputs with their text (`detokenize`), the choices stop strings ended finished."""
        if self.output_processor is None:
            return outputs
        processed = []
        for output in outputs:
            output, stops = self.output_processor.process(output)
            for stop in stops:
                self.stop_choice(stop)
            if output is not None:
                processed.append(output)
        return processed

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- the step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step and return the outputs it produced.

        Two paths. A scheduled step runs what the scheduler picks. A continued step follows a
        step in which sequences sampled, on the device (async scheduling): the engine queues it
        from the previous step's device outputs (and the next prompt chunks, known on the host)
        before it reads them, then reads and commits the previous step while the GPU runs on. A
        constrained batch's continued step is queued in two launches: its target forward first;
        then, once the previous step is committed (its tokens advanced every grammar, its
        `next_drafts` became each sequence's `drafts`), the grammars' bitmask is filled along
        those drafts and `sample_continued` queues accept, draft loop and copy. Sequences that
        ended in the previous step get all-allowed rows, whose results are dropped. That second
        launch always runs, even when every sequence ended: the tensor-parallel workers wait for
        its bitmask."""
        try:
            handle = self._inflight if self._inflight is not None else self._launch_scheduled()
            if handle is None:
                return []
            self._inflight = None
            if handle.continuable and self.args.async_scheduling:
                self._inflight = self._launch_continued(handle)
            outputs = self._processed(self._commit_step(handle))
            if self._inflight is not None and self._inflight.pending is not None:
                self._inflight = self.runner.sample_continued(self._inflight)
        except BaseException:
            # The prefix cache holds the rows of a step from its scheduling on: a step that
            # failed may have written none of them.
            self.reset_prefix_cache()
            raise
        if self._inflight is not None and all(
            s.status is Status.FINISHED for s in self._inflight.sequences
        ):
            self._inflight = None  # everything it computes was cut off by `handle`
        return outputs

    def _launch_scheduled(self) -> StepHandle | None:
        chunks = self.scheduler.schedule()
        if not chunks:
            return None
        self._mark_scheduled(chunks)
        draft_len = self.draft_length.choose(sum(chunk.samples for chunk in chunks))
        self.draft_length.launched(draft_len)
        self.stats.draft_length = draft_len
        for chunk in chunks:  # verify as many drafts as the step proposes: its rows stay uniform
            chunk.drafts = chunk.drafts[:draft_len]
        self.stats.record_step(sum(chunk.num_query for chunk in chunks))
        handle = self.runner.launch(chunks, draft_len)
        for chunk in chunks:
            if not chunk.samples:
                chunk.seq.num_computed += chunk.length
        return handle

    def _launch_continued(self, previous: StepHandle) -> StepHandle | None:
        """Queue the step after `previous` before reading it: the sequences that sampled in it
        verify once more with as many drafts (less those that ended in the step before it),
        beside the next chunks of the prompts part-way through and the first chunks of the
        requests the scheduler admits into the rest of the budget. It proposes as many drafts as
        the draft length chooses and verifies as many of the step before's as it proposes (a
        scheduled step does the same). None where the scheduler would run something else (a
        preemption), the KV does not fit, or a grammar's sequences would verify fewer drafts than
        they hold."""
        scheduler = self.scheduler
        keep = [i for i, s in enumerate(previous.sequences) if s.status is Status.RUNNING]
        seqs = [previous.sequences[i] for i in keep]
        draft_len = self.draft_length.choose(len(seqs))
        if draft_len != previous.draft_len and previous.inputs.sampling.constrained:
            return None  # its bitmask follows the drafts its sequences hold
        rows_before = previous.outputs.tokens.shape[1]
        rows_next = min(previous.draft_len, draft_len) + 1
        budget = scheduler.max_num_batched_tokens - len(seqs) * rows_next
        continuing = set(seqs)
        prompts = [s for s in scheduler.running if s not in continuing]  # part-way through
        if not seqs or budget < 0 or not all(_joins_continued_steps(s) for s in prompts):
            return None
        dropped = len(seqs) < len(previous.sequences)
        changed = dropped or bool(prompts)
        admits = scheduler.would_admit(budget)  # an upper bound: the prompts' chunks come first
        if admits and not _joins_continued_steps(scheduler.waiting[0]):
            return None  # the scheduled step admits it
        if (changed or admits) and not self.runner.can_change_continued(previous):
            return None
        # `previous` writes from num_computed on and may emit rows_before tokens after a sequence's
        # last token, then the next step writes rows_next rows (past a sequence's end too: the
        # rows of a sequence that ends in `previous` are dropped).
        spans = [(s, s.num_computed, s.num_tokens - 1 + rows_before + rows_next) for s in seqs]
        if not self.kv.grow_all(spans):
            return None
        chunks = scheduler.continue_prompts(continuing, budget) if prompts else []
        if chunks is None:
            return None
        budget -= sum(chunk.num_query for chunk in chunks)
        if admits:
            chunks += scheduler.admit(budget, _joins_continued_steps)
        self._mark_scheduled(chunks)
        self.num_continued_steps += 1
        self.draft_length.launched(draft_len)
        self.stats.draft_length = draft_len
        self.stats.record_step(len(seqs) * rows_next + sum(chunk.num_query for chunk in chunks))
        handle = self.runner.launch_continued(
            previous,
            [s.pages for s in seqs] + [chunk.seq.pages for chunk in chunks],
            draft_len,
            keep if dropped else None,
            chunks,
        )
        for chunk in chunks:
            if not chunk.samples:
                chunk.seq.num_computed += chunk.length
        return handle

    def _mark_scheduled(self, chunks: list[ScheduledChunk]) -> None:
        now = time.monotonic()
        for chunk in chunks:
            metrics = self.requests[chunk.seq.request_id].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now

    def _commit_step(self, handle: StepHandle) -> list[RequestOutput]:
        """Read a step's results, commit them to their sequences, and build the outputs."""
        touched: dict[str, Request] = {}
        for seq, entries in handle.prompt_logprobs().items():
            for position, entry in entries:
                if position == len(seq.prompt_logprobs) + 1:  # not scored before a recompute
                    seq.prompt_logprobs.append(entry)
        for seq, result in handle.results().items():
            if seq.status is Status.FINISHED:  # aborted, or cut off by the step before it
                continue
            req = self.requests[seq.request_id]
            self._record_drafts(result)
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = time.monotonic()
            self._append_tokens(req.choices[seq.index], result)
            touched[req.request_id] = req
        outputs = []
        for req in touched.values():
            outputs.append(self._output(req))
            if req.finished:
                self._count_finished(req)
                del self.requests[req.request_id]
        return outputs

    def _record_drafts(self, result: StepResult) -> None:
        """Speculative-decoding statistics of one sequence's step."""
        stats = self.stats
        stats.seq_steps += 1
        if not result.num_drafted:
            return
        accepted = len(result.tokens) - 1
        self.draft_length.observe(result.num_drafted, accepted)
        stats.spec_num_steps += 1
        stats.spec_drafted_tokens += result.num_drafted
        stats.spec_accepted_tokens += accepted
        for i in range(accepted):
            stats.spec_accepted_per_position[i] += 1

    def _append_tokens(self, choice: Choice, result: StepResult) -> None:
        """Append the step's tokens to the choice, up to the first stop condition."""
        seq = choice.sequence
        for j, token in enumerate(result.tokens):
            seq.token_ids.append(token)
            if seq.grammar is not None:
                seq.grammar.commit(token)
            choice.new_token_ids.append(token)
            self.stats.generation_tokens += 1
            if result.logprobs is not None:
                choice.new_logprobs.append(result.logprobs[j])
            reason, stop = self._stop_condition(seq, token)
            if reason is not None:
                seq.finish_reason, seq.stop_reason = reason, stop
                seq.num_computed = seq.num_tokens - 1  # rows with final KV, for the prefix cache
                self.scheduler.finish(seq)
                return
        seq.num_computed = seq.num_tokens - 1
        seq.drafts = result.next_drafts

    def _stop_condition(self, seq: Sequence, token: int) -> tuple[str | None, int | None]:
        """(finish reason, stop token) if the appended token ends the sequence, else (None, None).
        Stop strings are the output processor's."""
        params = seq.params
        if (not params.ignore_eos and token in self.eos_ids) or token in params.stop_token_ids:
            return "stop", token
        if seq.num_tokens >= seq.max_len:
            return "length", None
        return None, None

    def _count_finished(self, req: Request) -> None:
        """Count a request (not its choices) by its finish reason: "abort" if any choice was
        aborted, else the first choice's."""
        reasons = [seq.finish_reason for seq in req.sequences]
        reason = "abort" if "abort" in reasons else reasons[0]
        finished = self.stats.requests_finished
        finished[reason] = finished.get(reason, 0) + 1

    def _output(self, req: Request) -> RequestOutput:
        with_logprobs = req.params.logprobs is not None
        outputs = [choice.take_output(with_logprobs) for choice in req.choices]
        if req.finished:
            req.metrics.finished_time = time.monotonic()
        first = req.choices[0].sequence
        cached = first.num_cached_tokens or 0
        prompt_logprobs = None
        # The prompt is scored once a token was produced. Sent once: the output processor keeps
        # them (a long prompt's are ~100 kB, too much to copy and encode every step).
        if first.prompt_logprobs is not None and not req.prompt_logprobs_sent:
            prompt_logprobs = [None, *first.prompt_logprobs]
            req.prompt_logprobs_sent = True
        return RequestOutput(
            req.request_id,
            [],  # the output processor knows the prompt: no copy crosses the process boundary
            outputs,
            req.finished,
            req.metrics,
            cached,
            prompt_logprobs,
        )

    # ---- introspection --------------------------------------------------------------------------

    def snapshot(self) -> EngineStats:
        """A copy of the statistics, with the scheduler's and the pools' current counts."""
        stats = self.stats
        stats.num_running = len(self.scheduler.running)
        stats.num_waiting = len(self.scheduler.waiting)
        stats.kv_pages_total = self.kv.pool.capacity
        stats.kv_pages_free = self.kv.pool.num_free
        if self.kv.cache is not None:
            stats.prefix_cache_queries = self.kv.cache.num_queried_tokens
            stats.prefix_cache_hits = self.kv.cache.num_hit_tokens
        stats.num_preemptions = self.scheduler.num_preemptions
        return dataclasses.replace(
            stats,
            requests_finished=dict(stats.requests_finished),
            spec_accepted_per_position=list(stats.spec_accepted_per_position),
            iteration_tokens_counts=list(stats.iteration_tokens_counts),
        )

    def kv_pool_free(self) -> int:
        """Arena pages no sequence holds (free, or idle in the prefix cache)."""
        return self.kv.pool.num_free

    def reset_prefix_cache(self) -> None:
        if self.kv.cache is not None:
            self.kv.cache.clear()


def _joins_continued_steps(seq: Sequence) -> bool:
    """A waiting sequence can be admitted into a step continued on the device: nothing of its
    sampling needs the host between steps, and it scores no prompt tokens."""
    return seq.params.prompt_logprobs is None and not needs_host_between_steps(
        seq.params, seq.token_rules
    )
