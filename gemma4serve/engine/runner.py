"""Runs one step on the device: target forward, acceptance, draft loop, one copy of the results.

A step is launched, not awaited. Every step takes the same path:

    TargetBatch + SamplingInputs -> target forward (a CUDA graph where one fits, else eager:
    chosen in `forward` only) -> `accept` -> draft loop -> one copy of the outputs to the host.

The inputs come from one of two builders: `scheduled_batch` packs the scheduler's chunks on the
host; `_continued_inputs` derives the next decode step from the previous step's device outputs,
so the host queues it before it has read them. `StepHandle.results()` waits for the copy.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from gemma4serve.attention.metadata import (
    AttentionMetadata,
    HostBatch,
    Readout,
    causal_metadata,
    page_tables,
    readout_layout,
    to_device,
)
from gemma4serve.config import FULL, SLIDING
from gemma4serve.engine.cuda_graphs import CudaGraphs
from gemma4serve.engine.models import ModelState
from gemma4serve.engine.sampler import AcceptResult, SamplingBatch, TokenRuleTensors, accept
from gemma4serve.engine.sequence import ScheduledChunk, Sequence, Status
from gemma4serve.engine.spec import DraftLoop, ForcedAcceptance
from gemma4serve.engine.step_data import (
    PendingSampling,
    PinnedColumns,
    PinnedLogprobs,
    PinnedPromptLogprobs,
    PromptRows,
    SamplingInputs,
    StepHandle,
    StepOutputs,
    TargetBatch,
    TargetOutputs,
    to_host,
)
from gemma4serve.engine.step_plan import (
    ContinuedChanges,
    ContinuedPlan,
    SamplingPlan,
    ScheduledPlan,
)
from gemma4serve.kv.manager import SeqPages
from gemma4serve.model.gemma4 import ForwardContext
from gemma4serve.structured.bitmask import new_bitmask

if TYPE_CHECKING:
    from gemma4serve.parallel.workers import PlanReceiver, PlanSender

# Prompt rows are scored in slices of this many, so that their [rows, vocab] f32 logits stay small.
PROMPT_LOGPROB_SLICE = 256


# ---- building a step's inputs -------------------------------------------------------------------


def scheduled_batch(chunks: list[ScheduledChunk]) -> TargetBatch:
    """Host-side packing of the scheduler's chunks: their token ids, positions and page tables."""
    token_ids, positions = [], []
    for chunk in chunks:
        token_ids += chunk.seq.token_ids[chunk.start : chunk.start + chunk.length] + chunk.drafts
        positions += range(chunk.start, chunk.start + chunk.num_query)
    query_lens = [chunk.num_query for chunk in chunks]
    decode = all(
        chunk.length == 1 and chunk.samples and chunk.num_query == query_lens[0] for chunk in chunks
    )
    # Read after the forward: a sampling chunk's last row and drafts, a scored prompt's every row.
    readout = [
        chunk.num_query
        if chunk.seq.prompt_logprobs is not None
        else (len(chunk.drafts) + 1 if chunk.samples else 0)
        for chunk in chunks
    ]
    return TargetBatch(
        token_ids=torch.tensor(token_ids, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        page_tables=page_tables([chunk.seq.pages for chunk in chunks]),
        decode_query_len=query_lens[0] if decode else None,
        group_starts=torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32),
        key_lengths=torch.tensor([c.start + c.num_query for c in chunks], dtype=torch.int32),
        readout=None if readout == query_lens else torch.tensor(readout, dtype=torch.int32),
        chunk_context=max((c.start + c.num_query for c in chunks if c.length > 1), default=0),
    )


def sampling_plan(chunks: list[ScheduledChunk], batch: TargetBatch) -> SamplingPlan | None:
    """The rows and settings of the chunks that sample (None: the step only prefills)."""
    sampling = [(group, chunk) for group, chunk in enumerate(chunks) if chunk.samples]
    if not sampling:
        return None
    K = max(len(chunk.drafts) for _, chunk in sampling)
    ends = batch.group_starts[1:].tolist()
    rows, first_position, drafts, drafted = [], [], [], []
    for group, chunk in sampling:
        num_drafts = len(chunk.drafts)
        first = ends[group] - num_drafts - 1
        rows.append([first + min(j, num_drafts) for j in range(K + 1)])
        first_position.append(chunk.start + chunk.length - 1)
        drafts.append(chunk.drafts + [-1] * (K - num_drafts))
        drafted.append(num_drafts)
    sequences = [chunk.seq for _, chunk in sampling]
    return SamplingPlan(
        rows=rows,
        first_position=first_position,
        drafts=drafts,
        drafted=drafted,
        table_rows=[group for group, _ in sampling],
        params=[seq.params for seq in sequences],
        seeds=[seq.seed for seq in sequences],
        output_ids=[seq.output_ids for seq in sequences],
        prompt_ids=[seq.token_ids[: seq.num_prompt] for seq in sequences],
        token_rules=[seq.token_rules for seq in sequences],
        rows_are_all=[r for row in rows for r in row] == list(range(ends[-1])),
    )


def continued_changes(
    sequences: list[Sequence], keep: list[int] | None, prompt_chunks: list[ScheduledChunk]
) -> ContinuedChanges:
    """A continued step's changes from the step before, whose sampling sequences are
    `sequences`: it keeps those at `keep` (or all) and packs `prompt_chunks` after them."""
    assert not any(chunk.drafts for chunk in prompt_chunks), "a prompt chunk has no drafts"
    kept = sequences if keep is None else [sequences[i] for i in keep]
    sampling = [j for j, chunk in enumerate(prompt_chunks) if chunk.samples]
    every = kept + [prompt_chunks[j].seq for j in sampling]
    return ContinuedChanges(
        keep=keep,
        prompts=scheduled_batch(prompt_chunks) if prompt_chunks else None,
        sampling_chunks=sampling,
        first_positions=[prompt_chunks[j].start + prompt_chunks[j].length - 1 for j in sampling],
        params=[seq.params for seq in every],
        seeds=[seq.seed for seq in every],
        token_rules=[seq.token_rules for seq in every],
    )


def _without_sequences(rows: PromptRows | None) -> PromptRows | None:
    """Prompt rows as a worker needs them: which rows to score, not whom they belong to."""
    if rows is None:
        return None
    return PromptRows([], [], rows.rows, rows.targets, rows.width)


def _queued_to(settings, device: torch.device):
    """A SamplingBatch (or its TokenRuleTensors) built on the host, its tensors copied to `device`
    without waiting: built there directly, each would first drain the stream, that is wait for the
    step in flight."""
    moved = {}
    for name in (f.name for f in dataclasses.fields(settings)):
        value = getattr(settings, name)
        if isinstance(value, torch.Tensor):
            moved[name] = to_device(value, device)
        elif isinstance(value, TokenRuleTensors):
            moved[name] = _queued_to(value, device)
    return dataclasses.replace(settings, **moved)


@dataclass
class _ContinuationRows:
    """Index tensors of every continued step of B sequences x Q rows, made once (each would be a
    launch between two steps, and nothing writes them)."""

    rows: torch.Tensor  # [B, Q]
    num_drafts: torch.Tensor  # [B]
    table_rows: torch.Tensor  # [B] int32
    offsets: torch.Tensor  # [Q]


class ModelRunner:
    def __init__(
        self,
        state: ModelState,
        *,
        num_draft_tokens: int,
        forced: ForcedAcceptance | None = None,
        graphs: CudaGraphs | None = None,
        followers: PlanSender | None = None,
        leader: PlanReceiver | None = None,
    ):
        """Tensor parallelism: `followers` (rank 0) gets every step's plan, which the other
        ranks' runners take from their `leader`; both None on one device."""
        self.state = state
        self.followers = followers
        self.leader = leader
        self.num_draft_tokens = num_draft_tokens  # 0 without a drafter (the engine decides)
        self.draft_loop = DraftLoop(state) if num_draft_tokens else None
        self.forced = forced
        self.graphs = graphs
        self.window = {SLIDING: state.target.cfg.sliding_window, FULL: 0}
        self._continuation_rows: dict[tuple[int, int], _ContinuationRows] = {}

    # ---- the two entry points -------------------------------------------------------------------

    @torch.inference_mode()
    def launch(self, chunks: list[ScheduledChunk], draft_len: int) -> StepHandle:
        """Queue a scheduled step that proposes `draft_len` (0 to k) drafts for the next one."""
        batch = scheduled_batch(chunks)
        prompt_rows = self._prompt_rows(chunks, batch)
        plan = ScheduledPlan(batch, sampling_plan(chunks, batch), prompt_rows, draft_len)
        if self.followers is not None:
            sent = plan.sampling.as_sent() if plan.sampling is not None else None
            self.followers.send(
                ScheduledPlan(batch, sent, _without_sequences(prompt_rows), draft_len)
            )
        handle = self.run_scheduled(plan, [chunk.seq for chunk in chunks if chunk.samples])
        if self.followers is not None:
            self.followers.launched(handle)
        return handle

    def run_scheduled(self, plan: ScheduledPlan, sequences: list[Sequence] | None) -> StepHandle:
        """The step of a plan; `sequences`: the sampling ones (None on a tensor-parallel worker,
        which never reads its results)."""
        batch, sampling = plan.batch, plan.sampling
        inputs = self._sampling_inputs(sampling, sequences) if sampling is not None else None
        # A step some sequences of which sample is followed by their verify step, which
        # `launch_continued` can queue (beside the next chunks of the prompts part-way through).
        continuable = inputs is not None and not inputs.sampling.reads_history
        return self._run(
            batch,
            inputs,
            draft_len=plan.draft_len,
            continuable=continuable,
            prompt_rows=plan.prompt_rows,
        )

    @torch.inference_mode()
    def launch_continued(
        self,
        previous: StepHandle,
        pages: list[SeqPages],
        draft_len: int,
        keep: list[int] | None = None,
        prompt_chunks: list[ScheduledChunk] = (),
    ) -> StepHandle:
        """Queue the verify step after `previous` for the sequences that sampled in it, from its
        device outputs: all of them, or those at `keep` (the others ended in the step before
        it), beside `prompt_chunks` (prompts' next or first chunks, laid out on the host). It
        proposes `draft_len` drafts and verifies as many of `previous`'s as it proposes.
        `pages`, in that order, must already map every position the step can write. With `keep`
        or `prompt_chunks`, no sequence needs the host between steps (`can_change_continued`)."""
        tables = page_tables(pages)
        changes = None
        if keep is not None or prompt_chunks:
            changes = continued_changes(previous.inputs.sequences, keep, prompt_chunks)
        if self.followers is not None:
            self.followers.send(ContinuedPlan(tables, draft_len, changes))
        # A grammar's mask needs `previous` committed on the host: its sampling is queued later.
        sample = not previous.inputs.sampling.constrained
        new_sequences = [chunk.seq for chunk in prompt_chunks if chunk.samples]
        handle = self.run_continued(
            previous,
            tables,
            draft_len,
            sample=sample,
            changes=changes,
            new_sequences=new_sequences,
        )
        if self.followers is not None and sample:
            self.followers.launched(handle)
        return handle

    def can_change_continued(self, previous: StepHandle) -> bool:
        """Whether the step after `previous` can drop sequences or take in prompt chunks while it
        is continued on the device: its sampling settings are then rebuilt on the host, which
        needs nothing of `previous` (no grammar, penalty or bad-word tail)."""
        sampling = previous.inputs.sampling
        return not sampling.constrained and not sampling.reads_history

    def run_continued(
        self,
        previous: StepHandle,
        tables: dict[str, torch.Tensor],
        draft_len: int,
        *,
        sample: bool = True,
        changes: ContinuedChanges | None = None,
        new_sequences: list[Sequence] | None = None,
    ) -> StepHandle:
        """`sample` False: stop after the forward (`sample_continued` queues the rest). A
        tensor-parallel worker samples at once: it waits on its pipe for rank 0's bitmask.
        `new_sequences`: the sequences of `changes`' sampling prompt chunks (None on a worker)."""
        verify = min(previous.draft_len, draft_len)
        batch, inputs = self._continued_inputs(previous, tables, verify, changes, new_sequences)
        return self._run(
            batch,
            inputs,
            draft_len=draft_len,
            continuable=True,
            sample=sample,
        )

    @torch.inference_mode()
    def sample_continued(self, handle: StepHandle) -> StepHandle:
        """Queue the rest of a continued step launched without sampling, once the step before it
        is committed: the grammars' masks along the drafts it verifies (the step before's
        `next_drafts`, now each running sequence's `drafts`), accept, draft loop, copy."""
        inputs = handle.inputs
        for seq, drafted in zip(inputs.sequences, inputs.drafted):
            assert seq.status is Status.FINISHED or len(seq.drafts) == drafted, (
                "a continued step verifies exactly the drafts its sequences hold"
            )
        sampled = self._sample(inputs, handle.pending.target, handle.draft_len, handle.continuable)
        if self.followers is not None:
            self.followers.launched(sampled)
        return sampled

    # ---- the step -------------------------------------------------------------------------------

    def _run(
        self,
        batch: TargetBatch,
        inputs: SamplingInputs | None,
        *,
        draft_len: int,
        continuable: bool,
        prompt_rows: PromptRows | None = None,
        sample: bool = True,
    ) -> StepHandle:
        greedy = inputs is not None and inputs.sampling.argmax_only
        target = self.forward(batch, greedy=greedy)
        prompt_logprobs = self._score_prompt(prompt_rows, target) if prompt_rows else None
        if inputs is None:
            handle = StepHandle(None, _prompt_logprobs=prompt_logprobs)
            handle._done = self._record_done() if prompt_logprobs else None
            return handle
        if not sample:
            return StepHandle(inputs, None, draft_len, continuable, pending=PendingSampling(target))
        handle = self._sample(inputs, target, draft_len, continuable)
        handle._prompt_logprobs = prompt_logprobs
        return handle

    def _sample(
        self, inputs: SamplingInputs, target: TargetOutputs, draft_len: int, continuable: bool
    ) -> StepHandle:
        """Accept, draft loop and the copy to the host, after the target forward."""
        # Filled on the host while the device runs the forward queued before.
        bitmask = self._grammar_bitmask(inputs) if inputs.sampling.constrained else None
        outputs, logprobs = self._accept(inputs, target, bitmask)
        if draft_len:
            outputs.next_drafts = self._draft(inputs, target, outputs, draft_len)
        return self._copy_to_host(inputs, outputs, logprobs, draft_len, continuable)

    def _prompt_rows(self, chunks: list[ScheduledChunk], batch: TargetBatch) -> PromptRows | None:
        """The rows that score a prompt token not scored yet (host side, from the chunks)."""
        sequences, positions, rows, targets = [], [], [], []
        starts = batch.group_starts.tolist()
        for group, chunk in enumerate(chunks):
            seq = chunk.seq
            if seq.prompt_logprobs is None:
                continue
            # Row p scores token p + 1; prompt tokens 1 .. num_prompt - 1 need scoring once.
            first = max(chunk.start, len(seq.prompt_logprobs))
            for p in range(first, min(chunk.start + chunk.length, seq.num_prompt - 1)):
                sequences.append(seq)
                positions.append(p + 1)
                rows.append(starts[group] + p - chunk.start)
                targets.append(seq.token_ids[p + 1])
        if not rows:
            return None
        return PromptRows(
            sequences=sequences,
            positions=positions,
            rows=torch.tensor(rows, dtype=torch.int64),
            targets=torch.tensor(targets, dtype=torch.int64),
            width=max(seq.params.prompt_logprobs for seq in sequences),
        )

    def _score_prompt(self, prompt: PromptRows, target: TargetOutputs) -> PinnedPromptLogprobs:
        """Log-softmax of the model's logits at the prompt rows, in slices; copied to the host."""
        chosen, rank, top_ids, top_logprobs = [], [], [], []
        all_rows = to_device(prompt.rows, self.state.device)
        all_targets = to_device(prompt.targets, self.state.device)
        for start in range(0, all_rows.shape[0], PROMPT_LOGPROB_SLICE):
            rows = all_rows[start : start + PROMPT_LOGPROB_SLICE]
            targets = all_targets[start : start + PROMPT_LOGPROB_SLICE, None]
            logprobs = torch.log_softmax(
                self.state.target.logits(target.hidden[rows]).float(), dim=-1
            )
            scored = logprobs.gather(1, targets)
            chosen.append(scored[:, 0])
            rank.append((logprobs > scored).sum(dim=1) + 1)
            best = logprobs.topk(prompt.width, dim=-1)
            top_ids.append(best.indices)
            top_logprobs.append(best.values)
        return PinnedPromptLogprobs(
            prompt,
            to_host(torch.cat(chosen)),
            to_host(torch.cat(rank)),
            to_host(torch.cat(top_ids)),
            to_host(torch.cat(top_logprobs)),
        )

    def _record_done(self) -> torch.cuda.Event | None:
        if self.state.device.type != "cuda":
            return None
        done = torch.cuda.Event()
        done.record()
        return done

    def forward(self, batch: TargetBatch, *, greedy: bool) -> TargetOutputs:
        """The target over `batch`: a CUDA graph replay where one fits, else eager (the one place
        that chooses). `greedy`: only each row's argmax is needed (a greedy graph may run)."""
        graphs = self.graphs
        Q = batch.decode_query_len
        if (
            graphs is not None
            and Q is not None
            and graphs.fits(batch.num_groups, Q, batch.page_tables)
        ):
            hidden, logits, tokens = graphs.run_target(
                batch.token_ids, batch.positions, Q, batch.page_tables, greedy=greedy
            )
            return TargetOutputs(hidden, logits, tokens, graphs.tables, graphed=True)
        if graphs is not None and graphs.fits_mixed(batch):
            hidden = graphs.run_mixed(batch)
            return TargetOutputs(hidden, None, None, graphs.tables, graphed=True)
        state = self.state
        positions = to_device(batch.positions, state.device)
        meta = self._eager_metadata(batch, positions)
        token_ids = to_device(batch.token_ids, state.device)
        context = ForwardContext(meta, state.kv, state.attn, self._readout(batch))
        hidden = state.target(token_ids, positions, context)
        return TargetOutputs(hidden, None, None, meta.page_table, graphed=False)

    def _readout(self, batch: TargetBatch) -> Readout | None:
        """An eager pass's read-out rows (None: every row is read)."""
        if batch.readout is None:
            return None
        counts = batch.readout.tolist()
        rows, starts = readout_layout(batch.group_starts.tolist(), counts)
        device = self.state.device
        return Readout(
            rows=to_device(torch.tensor(rows, dtype=torch.int64), device),
            cu_seqlens_q=to_device(torch.tensor(starts, dtype=torch.int32), device),
            max_q_len=max(counts),
        )

    def _eager_metadata(self, batch: TargetBatch, positions: torch.Tensor) -> AttentionMetadata:
        device = self.state.device
        tables = {kind: to_device(t, device) for kind, t in batch.page_tables.items()}
        if batch.group_starts is not None:  # packed on the host
            sizes = batch.group_starts.diff()
            # On the device, sized by the host: the host's repeat_interleave took milliseconds.
            token_group = torch.repeat_interleave(
                torch.arange(batch.num_groups, dtype=torch.int32, device=device),
                to_device(sizes, device),
                output_size=positions.shape[0],
            )
            # No host layout where the keys' lengths are on the device only (a continued step).
            host = (
                HostBatch(batch.group_starts, batch.key_lengths, batch.page_tables)
                if batch.key_lengths is not None
                else None
            )
            return causal_metadata(
                token_group,
                positions,
                tables,
                self.window,
                to_device(batch.group_starts, device),
                int(sizes.max()),
                self.state.kv.page_tokens,
                host,
                batch.chunk_context,
            )
        Q = batch.decode_query_len
        T = positions.shape[0]
        i32 = {"dtype": torch.int32, "device": device}
        token_group = torch.div(torch.arange(T, **i32), Q, rounding_mode="floor")
        group_starts = torch.arange(0, T + 1, Q, **i32)
        return causal_metadata(
            token_group, positions, tables, self.window, group_starts, Q, self.state.kv.page_tokens
        )

    def _grammar_bitmask(self, inputs: SamplingInputs) -> torch.Tensor:
        """[B * (K+1), ceil(V / 32)] on the device: each grammar row's allowed tokens along its
        draft path, every token for the other sequences' rows (and for sequences that ended in
        the step before a continued one: their rows are dropped)."""
        if self.leader is not None:  # rank 0 fills it (it holds the grammars)
            return to_device(self.leader.recv(), self.state.device)
        B, K1 = inputs.rows.shape
        bitmask = new_bitmask(B * K1, self.state.target.cfg.vocab_size)
        for i, seq in enumerate(inputs.sequences):
            if seq.grammar is not None and seq.status is not Status.FINISHED:
                seq.grammar.fill_rows(bitmask, i * K1, seq.drafts[: inputs.drafted[i]])
        if self.followers is not None:
            self.followers.send(bitmask)
        return to_device(bitmask, self.state.device)

    def _accept(
        self, inputs: SamplingInputs, target: TargetOutputs, bitmask: torch.Tensor | None
    ) -> tuple[StepOutputs, AcceptResult]:
        """The sampled rows' logits (or greedy tokens) -> `accept` -> (tokens, num_emitted)."""
        B, K1 = inputs.rows.shape

        def sampled(t):  # the sampled rows of a tensor over the forward's rows
            return t if inputs.rows_are_all else t[inputs.rows.view(-1)]

        logits = chosen = None
        if target.greedy_tokens is not None:
            chosen = sampled(target.greedy_tokens)
        elif target.logits is not None:
            logits = sampled(target.logits)
        elif inputs.sampling.argmax_only:
            chosen = self.state.target.greedy(sampled(target.hidden))
        else:
            logits = self.state.target.logits(sampled(target.hidden))
        result = accept(
            logits.view(B, K1, -1) if logits is not None else None,
            inputs.drafts,
            inputs.num_drafts,
            inputs.first_position,
            inputs.sampling,
            chosen.view(B, K1) if chosen is not None else None,
            bitmask,
        )
        tokens, num_emitted = result.tokens, result.num_emitted
        if self.forced is not None and K1 > 1:
            tokens, num_emitted = self.forced.apply(
                tokens, num_emitted, inputs.drafts, inputs.num_drafts, inputs.first_position
            )
        return StepOutputs(tokens, num_emitted, None), result

    def _draft(
        self, inputs: SamplingInputs, target: TargetOutputs, outputs: StepOutputs, draft_len: int
    ) -> torch.Tensor:
        """The next drafts, seeded with the hidden state of each sequence's last accepted row and
        the newest token at P (rows < P are committed)."""
        last = (outputs.num_emitted - 1)[:, None]
        seed_hidden = target.hidden[inputs.rows.gather(1, last).squeeze(1)]
        seed_token = outputs.tokens.gather(1, last).squeeze(1)
        P = inputs.first_position + outputs.num_emitted  # position of the newest token
        graphs = self.graphs
        # Eager steps (prefill chunks) draft in the graph too, their page tables copied in: eagerly
        # the loop's launches cost the host more than the GPU's work. A replayed step's tables are
        # the graphs' own already.
        tables = None if target.graphed else target.page_tables
        if graphs is not None and graphs.fits_draft(len(inputs.sequences), draft_len, tables):
            return graphs.run_draft(
                seed_token, seed_hidden, P, inputs.table_rows, draft_len, tables
            )
        return self.draft_loop.run(
            seed_token, seed_hidden, P, inputs.table_rows, target.page_tables, draft_len
        )

    def _copy_to_host(
        self,
        inputs: SamplingInputs,
        outputs: StepOutputs,
        accepted: AcceptResult,
        draft_len: int,
        continuable: bool,
    ) -> StepHandle:
        no_drafts = outputs.tokens[:, :0]
        columns = {
            "tokens": outputs.tokens,
            "num_emitted": outputs.num_emitted[:, None],
            "next_drafts": outputs.next_drafts if outputs.next_drafts is not None else no_drafts,
        }
        logprobs = None
        if accepted.logprobs is not None:
            logprobs = PinnedLogprobs(
                to_host(accepted.logprobs),
                to_host(accepted.top_ids),
                to_host(accepted.top_logprobs),
            )
        ints = PinnedColumns(columns)
        done = None
        if self.state.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        return StepHandle(
            inputs, outputs, draft_len, continuable, _ints=ints, _logprobs=logprobs, _done=done
        )

    # ---- input builders -------------------------------------------------------------------------

    def _sampling_inputs(
        self, plan: SamplingPlan, sequences: list[Sequence] | None
    ) -> SamplingInputs:
        """Host -> device for verification and drafting, built before the forward is queued."""
        device = self.state.device
        B, K = len(plan.rows), len(plan.drafts[0])

        def int64(values):
            return to_device(torch.tensor(values, dtype=torch.int64), device)

        return SamplingInputs(
            sequences=sequences if sequences is not None else [None] * B,
            rows=int64(plan.rows),
            first_position=int64(plan.first_position),
            drafts=int64(plan.drafts).view(B, K),
            num_drafts=int64(plan.drafted),
            table_rows=to_device(torch.tensor(plan.table_rows, dtype=torch.int32), device),
            sampling=_queued_to(
                SamplingBatch.build(
                    plan.params, plan.seeds, plan.output_ids, plan.prompt_ids, plan.token_rules
                ),
                device,
            ),
            drafted=plan.drafted,
            rows_are_all=plan.rows_are_all,
        )

    def _continued_inputs(
        self,
        previous: StepHandle,
        tables: dict[str, torch.Tensor],
        verify: int,
        changes: ContinuedChanges | None,
        new_sequences: list[Sequence] | None,
    ) -> tuple[TargetBatch, SamplingInputs]:
        """Each sequence's newest token and the first `verify` of its next drafts, at the
        positions after its outputs (all sequences, or those `changes` keeps), then the rows of
        `changes`' prompt chunks."""
        assert previous.pending is None, "a step is continued after its sampling is queued"
        outputs, device = previous.outputs, self.state.device
        Q = verify + 1
        P = previous.inputs.first_position + outputs.num_emitted  # position of each newest token
        if previous.draft_len:
            newest = outputs.tokens.gather(1, (outputs.num_emitted - 1)[:, None])
            token_ids = torch.cat([newest, outputs.next_drafts[:, :verify]], dim=1)
            positions = P[:, None] + self._continuation(P.shape[0], Q).offsets
        else:
            # One token a step, the newest (it may be the last replay's graph output: it is copied
            # into the graph's inputs before the next replay).
            token_ids, positions = outputs.tokens, P[:, None]
        sequences = previous.inputs.sequences
        keep = changes.keep if changes is not None else None
        if keep is not None:
            kept = to_device(torch.tensor(keep, dtype=torch.int64), device)
            token_ids, positions, P = token_ids[kept], positions[kept], P[kept]
            sequences = [sequences[i] for i in keep]
        B = len(sequences)
        index = self._continuation(B, Q)
        if changes is None:
            batch = TargetBatch(
                token_ids=token_ids.view(-1),
                positions=positions.view(-1),
                page_tables=tables,
                decode_query_len=Q,
            )
            # The drafts as copied into `token_ids`: `next_drafts` may be a graph output, which
            # the target replay can overwrite (graphs share one memory pool).
            inputs = SamplingInputs(
                sequences=sequences,
                rows=index.rows,
                first_position=P,
                drafts=token_ids[:, 1:],
                num_drafts=index.num_drafts,
                table_rows=index.table_rows,
                sampling=previous.inputs.sampling,
                drafted=[Q - 1] * B,
                rows_are_all=True,
            )
            return batch, inputs
        if new_sequences is None:  # a worker's
            new_sequences = [None] * len(changes.sampling_chunks)
        return self._changed_continued_inputs(
            token_ids, positions, P, sequences + new_sequences, index, tables, changes
        )

    def _changed_continued_inputs(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        newest_position: torch.Tensor,
        sequences: list[Sequence | None],
        index: _ContinuationRows,
        tables: dict[str, torch.Tensor],
        changes: ContinuedChanges,
    ) -> tuple[TargetBatch, SamplingInputs]:
        """A continued step whose sequences changed: the continued rows [B, Q] (device) packed
        before the prompt chunks' rows (host), and sampling settings rebuilt for them all.
        `sequences`: the kept ones, then the sampling prompt chunks'."""
        device = self.state.device
        B, Q = token_ids.shape
        packed = changes.prompts
        if packed is None:
            batch = TargetBatch(
                token_ids.reshape(-1), positions.reshape(-1), tables, decode_query_len=Q
            )
        else:
            starts = packed.group_starts[1:] + B * Q
            batch = TargetBatch(
                token_ids=torch.cat([token_ids.reshape(-1), to_device(packed.token_ids, device)]),
                positions=torch.cat([positions.reshape(-1), to_device(packed.positions, device)]),
                page_tables=tables,
                decode_query_len=None,
                group_starts=torch.cat(
                    [torch.arange(0, B * Q + 1, Q, dtype=torch.int32), starts.to(torch.int32)]
                ),
                readout=torch.cat(
                    [torch.full((B,), Q, dtype=torch.int32), packed.readout_counts().int()]
                ),
                chunk_context=packed.chunk_context,
            )
        # Prompt chunks that sample (their prompts' last): their last row, repeated as a verify's
        # Q rows.
        ends = batch.group_starts[1:].tolist() if packed is not None else []
        last_rows = [ends[B + j] - 1 for j in changes.sampling_chunks]
        table_rows = [B + j for j in changes.sampling_chunks]
        A = len(last_rows)

        def int64(values):
            return to_device(torch.tensor(values, dtype=torch.int64), device)

        no_history = [[] for _ in changes.params]  # nothing reads it (can_change_continued)
        inputs = SamplingInputs(
            sequences=sequences,
            rows=torch.cat([index.rows, int64(last_rows)[:, None].expand(A, Q)]),
            first_position=torch.cat([newest_position, int64(changes.first_positions)]),
            drafts=torch.cat(
                [token_ids[:, 1:], torch.full((A, Q - 1), -1, dtype=torch.int64, device=device)]
            ),
            num_drafts=torch.cat([index.num_drafts, int64([0] * A)]),
            table_rows=torch.cat(
                [index.table_rows, to_device(torch.tensor(table_rows, dtype=torch.int32), device)]
            ),
            sampling=_queued_to(
                SamplingBatch.build(
                    changes.params, changes.seeds, no_history, no_history, changes.token_rules
                ),
                device,
            ),
            drafted=[Q - 1] * B + [0] * A,
            rows_are_all=packed is None,
        )
        return batch, inputs

    def _continuation(self, B: int, Q: int) -> _ContinuationRows:
        if (B, Q) not in self._continuation_rows:
            device = self.state.device
            self._continuation_rows[(B, Q)] = _ContinuationRows(
                rows=torch.arange(B * Q, device=device).view(B, Q),
                num_drafts=torch.full((B,), Q - 1, device=device, dtype=torch.int64),
                table_rows=torch.arange(B, device=device, dtype=torch.int32),
                offsets=torch.arange(Q, device=device),
            )
        return self._continuation_rows[(B, Q)]
