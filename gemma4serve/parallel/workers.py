"""Ranks 1..N-1 of tensor parallelism: processes the engine starts itself, each running the model
runner on its shard over the plans rank 0 sends (docs/architecture.md, "Tensor parallelism").

Plans travel over one pipe per worker (pickled once, written to each): a worker waits on its pipe
without a collective's timeout however long the server idles, and sees rank 0 go as the pipe's
end. A worker that dies takes rank 0 down (`os._exit(1)`), so the server fails its requests and
exits instead of waiting on a collective that will never complete.
"""

from __future__ import annotations

import gc
import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from gemma4serve.engine.args import EngineArgs
from gemma4serve.engine.step_plan import ContinuedPlan, ScheduledPlan, Stop
from gemma4serve.parallel.group import FusedAllReduceNorm, OneShotAllReduce, TensorParallel

log = logging.getLogger("gemma4serve")

# Bounds one collective: start-up (loading) included, so it is generous.
COLLECTIVE_TIMEOUT = timedelta(minutes=30)
PARENT_POLL_S = 0.5  # a worker (an engine process) checks this often that its parent is there
STOP_TIMEOUT_S = 10.0


class StepLog:
    """`tensor_parallel_step_log`: each step's tokens as this rank computed them, a JSON line per
    step (a host sync per step: for tests)."""

    def __init__(self, folder: str, rank: int):
        Path(folder).mkdir(parents=True, exist_ok=True)
        self.file = open(Path(folder) / f"rank{rank}.jsonl", "a")  # noqa: SIM115

    def write(self, handle) -> None:
        outputs = handle.outputs
        line = None
        if outputs is not None:
            drafts = outputs.next_drafts
            line = {
                "tokens": outputs.tokens.tolist(),
                "num_emitted": outputs.num_emitted.tolist(),
                "next_drafts": drafts.tolist() if drafts is not None else None,
            }
        self.file.write(json.dumps(line) + "\n")
        self.file.flush()


class PlanSender:
    """Rank 0's end: every plan (and grammar bitmask) goes to every worker, in order."""

    def __init__(
        self, connections: list[multiprocessing.connection.Connection], log: StepLog | None
    ):
        self.connections = connections
        self.log = log

    def send(self, obj) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        for connection in self.connections:
            connection.send_bytes(data)

    def launched(self, handle) -> None:
        """Rank 0 launched the step of the plan just sent."""
        if self.log is not None:
            self.log.write(handle)


class PlanReceiver:
    """A worker's end."""

    def __init__(self, connection: multiprocessing.connection.Connection):
        self.connection = connection

    def recv(self):
        return pickle.loads(self.connection.recv_bytes())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(
    rank: int, size: int, init_method: str, device: torch.device, custom_all_reduce: bool
) -> TensorParallel:
    """Join the group; on CUDA also the custom all-reduces' buffers unless switched off (every
    rank gets the same `custom_all_reduce`, so all or none make the collective buffers)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT
    )
    group = dist.group.WORLD
    tp = TensorParallel(rank, size, group)
    if device.type != "cuda" or not custom_all_reduce:
        return tp
    one_shot = OneShotAllReduce.create(group, device)
    # All ranks or none: a rank whose buffers failed makes every rank keep NCCL.
    if tp.min_int(int(one_shot is not None), device) == 0:
        return tp
    fused_norm = FusedAllReduceNorm.create(tp, device)
    if tp.min_int(int(fused_norm is not None), device) == 0:
        fused_norm = None
    return TensorParallel(rank, size, group, one_shot, fused_norm)


def _rank_device(args: EngineArgs, rank: int) -> torch.device:
    """Rank r runs on cuda:r (or the CPU)."""
    from gemma4serve.engine.models import resolve_device_dtype

    device, _ = resolve_device_dtype(args)
    if device.type == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    return device


class TensorParallelWorkers:
    """Rank 0's handle on the other ranks: their processes, the plan pipes and the group."""

    def __init__(self, args: EngineArgs, log_level: str | None):
        size = args.tensor_parallel_size
        device = _rank_device(args, 0)
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        spawn = multiprocessing.get_context("spawn")  # CUDA must not be forked
        self.processes: list[multiprocessing.process.BaseProcess] = []
        connections = []
        for rank in range(1, size):
            receiver, sender = spawn.Pipe(duplex=False)
            process = spawn.Process(
                target=run_worker,
                args=(args, rank, init_method, receiver, os.getpid(), log_level),
                name=f"gemma4serve-tp{rank}",
                daemon=True,
            )
            process.start()
            receiver.close()  # the worker holds the only reading end
            log.info("tensor-parallel worker rank %d started (pid %d)", rank, process.pid)
            self.processes.append(process)
            connections.append(sender)
        folder = args.tensor_parallel_step_log
        self.plans = PlanSender(connections, StepLog(folder, 0) if folder else None)
        self._stopping = False
        threading.Thread(target=self._watch, name="gemma4serve-tp-watch", daemon=True).start()
        self.tp = init_group(0, size, init_method, device, not args.disable_custom_all_reduce)

    def _watch(self) -> None:
        """A worker that exits before `stop` leaves rank 0 nothing to wait for: end this process
        (the server sees its engine gone: requests fail, /health fails, it exits 1)."""
        sentinels = {p.sentinel: p for p in self.processes}
        ready = multiprocessing.connection.wait(list(sentinels))
        if self._stopping:
            return
        dead = sentinels[ready[0]]
        dead.join(0.1)
        log.error(
            "tensor-parallel worker %s exited (code %s); stopping the engine",
            dead.name,
            dead.exitcode,
        )
        logging.shutdown()
        os._exit(1)

    def stop(self) -> None:
        """Tell every worker to leave, wait for them, and leave the group."""
        if self._stopping:
            return
        self._stopping = True
        try:
            self.plans.send(Stop())
        except OSError:
            pass
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
        for connection in self.plans.connections:
            connection.close()
        if dist.is_initialized():
            leave_group()


def leave_group() -> None:
    """Leave the group without waiting for the other ranks (they leave too, or are gone): NCCL's
    destroy would wait for every rank's, so NCCL groups are aborted; gloo's destroy is local.
    Callers drop their CUDA graphs first: NCCL's abort waits for every graph that captured one of
    its kernels to be freed."""
    if dist.get_backend() == "nccl":
        gc.collect()  # graphs in reference cycles
        torch.cuda.synchronize()
        dist.distributed_c10d._abort_process_group()
    else:
        dist.destroy_process_group()


def stopped_by_parent(parent_pid: int) -> None:
    """For a process its parent stops (an engine process, a tensor-parallel worker): the stop
    signals that reach every process of the service (Ctrl-C the process group, systemd the
    control group) are ignored, the parent drains and stops it; and it exits once `parent_pid` is
    no longer its parent, whatever it is doing (loading weights, inside a collective that would
    wait)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)

    def watch():
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="gemma4serve-parent-watch", daemon=True).start()


def run_worker(
    args: EngineArgs,
    rank: int,
    init_method: str,
    connection: multiprocessing.connection.Connection,
    leader_pid: int,
    log_level: str | None,
) -> None:
    """Rank `rank`'s process: load its shard, then run each plan rank 0 sends until `Stop`."""
    if log_level is not None:
        from gemma4serve.cli import setup_logging

        # Rank 0 logs what every rank does (loading, KV sizing); workers only their problems.
        setup_logging(log_level if log_level == "debug" else "warning")
    stopped_by_parent(leader_pid)
    from gemma4serve.engine.attention_variants import compile_attention_variants
    from gemma4serve.engine.cuda_graphs import capture_graphs
    from gemma4serve.engine.models import load_models
    from gemma4serve.engine.runner import ModelRunner
    from gemma4serve.engine.spec import ForcedAcceptance

    device = _rank_device(args, rank)
    tp = init_group(
        rank, args.tensor_parallel_size, init_method, device, not args.disable_custom_all_reduce
    )
    state = load_models(args, tp)
    k = args.num_draft_tokens if state.draft is not None else 0
    forced = ForcedAcceptance.from_args(args, k, state.device)
    compile_attention_variants(state, args, k)
    graphs, _ = capture_graphs(state, args, k)  # rank 0 captures the same, at the same point
    plans = PlanReceiver(connection)
    runner = ModelRunner(state, num_draft_tokens=k, forced=forced, graphs=graphs, leader=plans)
    folder = args.tensor_parallel_step_log
    step_log = StepLog(folder, rank) if folder else None
    handle = None
    with torch.inference_mode():
        while True:
            try:
                plan = plans.recv()
            except EOFError:  # rank 0 is gone
                os._exit(1)
            if isinstance(plan, Stop):
                break
            if isinstance(plan, ScheduledPlan):
                handle = runner.run_scheduled(plan, None)
            else:
                assert isinstance(plan, ContinuedPlan), plan
                handle = runner.run_continued(
                    handle, plan.page_tables, plan.draft_len, changes=plan.changes
                )
            if step_log is not None:
                step_log.write(handle)
    runner.graphs = None  # see leave_group
    del graphs, handle
    leave_group()
