"""The PPO critic in its own process, beside the trainer's actor and sharing no interpreter lock with it.

Why: on one rank of a CPU box the critic's updates can run beside the actor's on a second thread
(ppo.overlap_critic), but two threads share one interpreter lock, and at small widths (the demo's hidden 64, a
few hundred operator calls per step) both are mostly Python and operator dispatch, which two processes do in
parallel and two threads do not (docs/rl.md#speed-options, ppo.critic_process). The values pass runs here too,
beside the trainer's scoring and reference pass.

What it is: `CriticWorker`, a process that builds the critic exactly as the trainer would
(`load_critic_model` + `initialize_trainer` with the same settings, the same attention implementation and LoRA
per ppo.lora), and a proxy the PPO stage holds where it held the critic: `values_async` (the no-grad values
pass), `train_async` (every minibatch's update of an iteration, queued at once, as the critic's thread takes
them), `proceed` (the gate of the actor's check of the old log-probs: the first update waits for it before
stepping, and a False drops its gradients and ends the iteration's updates, so a stale check leaves the critic
untouched), `save_state` and `load_state` (checkpoints), `save_trained`, `close`. The same updates in the same
order as on the thread, one torch thread each way: the tests compare weights and metrics bit for bit.

Start-up: the stage starts the process before anything else. It is forked where that is safe (a stage program
that has computed nothing yet: stages/common/forking.py), so it starts with this process's imports and only
loads the model; elsewhere (a test, a library caller) it is spawned and imports torch, transformers and this
stage's modules again first (~4 s on a 2-core EPYC), and the first request, iteration 1's values, waits for
that.

Protocol: one duplex pipe; each request gets exactly one reply, in order (`proceed` is one-way). Payloads are
plain pickle with CPU tensors as numpy arrays (`_Pickler`): the multiprocessing pickler moves every tensor it
sends into shared memory, and torch's own reduction costs several times more to dump and load than the arrays'
bytes. Failure: a request that raises in the worker is re-raised in the trainer with the worker's traceback as
a note (a NaN value loss keeps its type, so the stage's last-good-checkpoint path applies); a worker that dies
makes the next wait raise `CriticWorkerError` naming its pid and exit code or signal within POLL_S; a failed
start is named at the first request; a trainer that dies closes the pipe, and the worker exits on the EOF.
What it is not: a critic on other ranks or hosts (one rank, the plain torch trainer, CPU: where overlap_critic
applies), or a GPU one.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import pickle
import sys
import time
import traceback
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from alignflow.config import PPOConfig
from alignflow.stages.common import forking
from alignflow.stages.common.training.deepspeed_setup import OptimSettings
from alignflow.stages.common.training.lora import apply_lora, save_trained, unwrap_lora
from alignflow.stages.common.training.packing import PackedRows
from alignflow.stages.common.training.plain_trainer import initialize_trainer
from alignflow.stages.common.training.precision import Precision
from alignflow.stages.common.training.trainer_state import load_trainer_state, save_trainer_state
from alignflow.stages.ppo.experience import Experience, token_values
from alignflow.stages.ppo.rollout_workers import describe_exit

POLL_S = 0.1  # how often a wait checks that the worker is alive
START_TIMEOUT_S = 300.0  # imports and the model load take seconds; a worker silent this long is stuck
CLOSE_WAIT_S = 5.0


class CriticWorkerError(RuntimeError):
    """The critic's process died, could not start, or broke the protocol."""


def load_critic_model(folder: Path | str, cfg: PPOConfig, dtype: str) -> torch.nn.Module:
    """The critic's model, as the PPO stage makes it: the reward model's sequence classifier (LoRA per
    ppo.lora)."""
    from alignflow.stages.common.models.loading import load_sequence_classifier

    return apply_lora(load_sequence_classifier(folder, dtype=dtype), cfg.lora, "ppo.lora", classifier=True)


@dataclass(frozen=True)
class CriticSpec:
    """What the worker needs to build the critic the trainer would (pickled into a spawned process)."""

    folder: str          # the reward model's output: the critic's initial weights
    cfg: PPOConfig
    dtype: str
    optim: OptimSettings
    attention: str       # the training attention implementation (training_attention)
    precision: Precision
    threads: int         # torch threads of the worker


@dataclass(frozen=True)
class Update:
    """One minibatch of an iteration's critic updates: its rows (values, returns, mask) and their packing."""

    rows: Experience
    packed: PackedRows | None


def build_critic(spec: CriticSpec):
    """The critic's training engine (plain torch trainer), its attention as the trainer sets it."""
    critic = initialize_trainer(load_critic_model(spec.folder, spec.cfg, spec.dtype), spec.optim, "torch")
    unwrap_lora(critic.module).set_attn_implementation(spec.attention)
    return critic


def critic_values(critic, exp: Experience, packed: PackedRows | None, cfg: PPOConfig, precision: Precision
                  ) -> torch.Tensor:
    """The no-grad values pass: (B, R) V(s_t) of exp's rows, as the PPO stage's own pass computes them on one
    rank."""
    with torch.no_grad(), precision.forward():
        return token_values(critic.module, exp, lean=cfg.fast_train_step, packed=packed)


class _Pickler(pickle.Pickler):
    """Plain pickle, with CPU tensors that numpy can hold pickled as numpy arrays: the same bytes, read back
    as tensors sharing the loaded arrays' memory, for a fraction of what torch's own reduction costs to dump
    and load."""

    def reducer_override(self, obj: Any) -> Any:
        if (isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and obj.dtype in _NUMPY_DTYPES
                and not obj.requires_grad and type(obj) is torch.Tensor):
            return torch.from_numpy, (obj.numpy(),)
        return NotImplemented


_NUMPY_DTYPES = {
    torch.float32,
    torch.float64,
    torch.float16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
}


def _send(conn, message: Any) -> None:
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(message)
    conn.send_bytes(buffer.getbuffer())


def _receive(conn) -> Any:
    return pickle.loads(conn.recv_bytes())


def _serve(conn, spec: CriticSpec, trainers_end=None) -> None:
    """The worker's loop: build the critic, then answer requests until 'close' or the trainer's end of the
    pipe. A forked worker is given the trainer's end of the pipe, which it inherited, to close."""
    if trainers_end is not None:
        trainers_end.close()
    torch.set_num_threads(spec.threads)
    # What LoRA draws at its start, the same whether this process was forked (the trainer's generator state)
    # or spawned (a fresh one).
    torch.manual_seed(spec.cfg.seed)
    try:
        critic = build_critic(spec)
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the trainer, named
        _send(conn, ("error", _portable(exc), traceback.format_exc()))
        return
    _send(conn, ("ok", None))
    cfg, precision = spec.cfg, spec.precision
    while True:
        try:
            kind, *args = _receive(conn)
        except (EOFError, OSError):  # the trainer is gone: nothing is left to answer
            return
        if kind == "close":
            return
        if kind == "proceed":  # the gate of an iteration whose first update failed before asking for it
            continue
        try:
            if kind == "values":
                result: Any = critic_values(critic, *args, cfg, precision)
            elif kind == "train":
                result = _train(conn, critic, *args, cfg, precision)
            elif kind == "save_state":
                save_trainer_state(critic, Path(args[0]))
                result = None
            elif kind == "load_state":
                load_trainer_state(critic, Path(args[0]), args[1])
                result = None
            elif kind == "save_trained":
                save_trained(critic, Path(args[0]))
                result = None
            else:
                raise CriticWorkerError(f"unknown request {kind!r}")
            reply: tuple = ("ok", result)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the trainer
            reply = ("error", _portable(exc), traceback.format_exc())
        try:
            _send(conn, reply)
        except (BrokenPipeError, OSError):  # the trainer died while this request ran
            return


def _train(
    conn, critic, updates: list[Update], iteration: int, gated: bool, cfg: PPOConfig, precision: Precision
) -> list[dict[str, float]]:
    """An iteration's updates; gated: the first waits for the trainer's 'proceed' before stepping, and a False
    ends them all there (the actor's check failed: nothing steps this iteration)."""
    gate: list[bool] = []

    def proceed() -> bool:  # asked once, by the first update; the rest reuse its answer
        if not gate:
            message = _receive(conn)
            if message[0] != "proceed":
                raise CriticWorkerError(f"expected the 'proceed' gate, got {message[0]!r}")
            gate.append(bool(message[1]))
        return gate[0]

    # The trainer's own update (its checks and NonFiniteError); imported here, as training_loop imports this
    # module.
    from alignflow.stages.ppo.training_loop import value_update

    critic.train()  # as the trainer sets its own critic before each iteration's updates
    results = []
    for update in updates:
        metrics = value_update(
            critic, update.rows, update.packed, cfg, precision, iteration, proceed if gated else lambda: True
        )
        if gated and not gate[0]:
            break
        results.append({key: float(value) for key, value in metrics.items()})
    return results


def _portable(exc: BaseException) -> BaseException:
    """exc if it survives pickling (its type re-raised as is in the trainer), else a CriticWorkerError with
    its text."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any unpicklable exception
        return CriticWorkerError(f"{type(exc).__name__}: {exc}")


class Pending:
    """A request's reply, read in order when asked for (the pipe answers requests in the order they were
    sent)."""

    def __init__(self, worker: CriticWorker, doing: str):
        self._worker, self._doing = worker, doing
        self._done, self._value, self._error = False, None, None

    def result(self) -> Any:
        """The reply's value, or the worker's exception raised here (every time it is asked)."""
        if not self._done:
            self._worker._settle_before(self)
            try:
                self._value = self._worker._reply(self._doing)
            except BaseException as exc:
                self._error = exc
            self._done = True
            self._worker._outstanding.remove(self)
        if self._error is not None:
            raise self._error
        return self._value


class CriticWorker:
    """The critic in its own process (forked or spawned: `start_method`); see the module docstring. Use with
    contextlib.closing."""

    def __init__(self, spec: CriticSpec):
        self.start_method = forking.start_method()
        context = mp.get_context(self.start_method)
        if self.start_method == "fork":  # what this process has buffered must not be written twice
            sys.stdout.flush()
            sys.stderr.flush()
        self._conn, child = context.Pipe(duplex=True)
        # A forked worker inherits this end as well and closes it: held open there, the trainer's death would
        # never reach the worker as an EOF, and it would wait for a request forever.
        inherited = self._conn if self.start_method == "fork" else None
        self.process = context.Process(
            target=_serve, args=(child, spec, inherited), name="alignflow-critic", daemon=True
        )
        self.process.start()
        child.close()
        self._outstanding: list[Pending] = []
        self._broken: CriticWorkerError | None = None
        self._started = Pending(self, "loading the critic")
        self._outstanding.append(self._started)

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def wait_ready(self) -> None:
        """Block until the critic is built (the worker loads while the trainer loads its own models)."""
        self._started.result()

    def values_async(self, exp: Experience, packed: PackedRows | None) -> Pending:
        """The (B, R) values of exp's rows (packed: its packing, as the trainer's passes take it)."""
        return self._request("computing the values", "values", exp, packed)

    def train_async(self, updates: list[Update], iteration: int, gated: bool) -> Pending:
        """Every update of an iteration; with `gated` the first waits for proceed() before stepping."""
        return self._request("training the critic", "train", updates, iteration, gated)

    def proceed(self, go: bool) -> None:
        """Answer the gate of the pending gated train_async: True steps, False drops the first update's
        gradients."""
        self._post(("proceed", go))

    def save_state(self, folder: Path) -> None:
        """The critic trainer's state into `folder` (stages/common/training/trainer_state.py)."""
        self._request("saving the critic's checkpoint", "save_state", str(folder)).result()

    def load_state(self, folder: Path, where: str) -> None:
        """Resume the critic trainer from the state in `folder` (`where` names it in errors)."""
        self._request("loading the critic's checkpoint", "load_state", str(folder), where).result()

    def save_trained(self, out: Path) -> None:
        self._request("saving the trained critic", "save_trained", str(out)).result()

    def close(self) -> None:
        """Stop the worker (after its pending replies, unless it is broken); safe after a failure and
        twice."""
        if self.process.exitcode is None:
            # Its pending replies first, for at most CLOSE_WAIT_S: a stuck worker is killed.
            if self._broken is None:
                deadline = time.monotonic() + CLOSE_WAIT_S
                for pending in list(self._outstanding):
                    if not self._conn.poll(max(0.0, deadline - time.monotonic())):
                        break
                    with suppress(BaseException):  # an error nobody read: closing still stops the worker
                        pending.result()
            with suppress(CriticWorkerError, OSError):
                self._post(("close",))
            self.process.join(CLOSE_WAIT_S)
            if self.process.exitcode is None:
                self.process.kill()
                self.process.join(CLOSE_WAIT_S)
        self._conn.close()

    # -- plumbing -----------------------------------------------------------------------------------------

    def _request(self, doing: str, *message: Any) -> Pending:
        self._post(message)
        pending = Pending(self, doing)
        self._outstanding.append(pending)
        return pending

    def _post(self, message: Any) -> None:
        if self._broken is not None:
            raise self._broken
        try:
            _send(self._conn, message)
        except (BrokenPipeError, OSError) as exc:
            raise self._died(f"sending to it ({exc})") from None

    def _settle_before(self, pending: Pending) -> None:
        """Read the replies of earlier requests first, so replies stay in order; each keeps its value or error
        for whoever asks it (a dead worker raises again at the next wait)."""
        for earlier in list(self._outstanding):
            if earlier is pending:
                return
            with suppress(BaseException):
                earlier.result()

    def _reply(self, doing: str) -> Any:
        started = time.monotonic()
        while not self._conn.poll(POLL_S):
            if self.process.exitcode is not None:
                raise self._died(doing)
            if doing == "loading the critic" and time.monotonic() - started > START_TIMEOUT_S:
                self._broken = CriticWorkerError(
                    f"the critic worker (pid {self.pid}) did not start within {START_TIMEOUT_S:g} s"
                )
                raise self._broken
        try:
            status, *rest = _receive(self._conn)
        except (EOFError, OSError):
            raise self._died(doing) from None
        if status == "ok":
            return rest[0]
        exc, worker_traceback = rest
        exc.add_note(f"raised in the critic worker (pid {self.pid}) while {doing}:\n{worker_traceback}")
        if doing == "loading the critic":
            self._broken = CriticWorkerError(f"the critic worker (pid {self.pid}) could not start: {exc}")
            raise self._broken from exc
        raise exc

    def _died(self, doing: str) -> CriticWorkerError:
        self.process.join(POLL_S)
        self._broken = CriticWorkerError(
            f"the critic worker (pid {self.pid}) died ({describe_exit(self.process.exitcode)}) while "
            f"{doing}; the stage cannot go on without it (a re-run resumes from the last checkpoint)"
        )
        return self._broken
