"""Model instances as processes (``Server(instance_kind="process")``): each
instance's model runs in a child process of its own, past the GIL, fed by a
worker thread of the server like any instance.

The staging slots and each instance's output buffers are shared memory
(``share_memory_``, before the batcher writes into them), mapped by the
children once at start: a batch crosses the process boundary as a slot
index and a row range on a pipe (``("run", slot, start, rows, requests)``),
its outputs come back in the instance's output buffers, copied out by the
worker thread before the next batch can overwrite them. A child that
raises answers ``("error", exception)``; one whose model failed some of
its requests (:class:`RequestsFailed`) answers ``("partly", errors)``, the
call's outputs in the buffers, so that each of those requests gets its own
error and the others their rows, as on a thread instance.

A child that dies (``kill -9``) during a batch is replaced, and the batch
runs once more on the new process (with ``isolate_failures``; a child that
dies again there fails it, its requests then retried in halves as any
failed batch). A child that dies between batches is replaced as soon as a
watcher thread sees it (``waitpid`` every ``WATCH_S``), before a batch
comes for it; a batch its instance took before (its process gone, none
could be started) runs on another instance's process. One that cannot be started fails the batches it takes at once
(:class:`InstanceDownError`) while no other instance runs; while another
does, it leaves them the batches and tries again, waiting longer each
time. A child whose parent is gone reads end-of-file on its pipe and
exits; it ignores SIGINT, as a terminal's Ctrl-C reaches the whole process
group: the server decides when its instances stop.

Fixed-shape tensors only; the model must be picklable (``spawn``).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.connection
import os
import pickle
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing as torch_mp

from . import _core
from ._executor import InstanceDownError, RequestsFailed, yield_to_front_end
from ._requests import RequestInfo
from ._torch import CpuExecutor, adapt_model, model_mode, normalize_outputs
from .errors import ModelError, ServerClosedError
from .specs import TensorSpec

log = logging.getLogger("ferrobatch")

#: Seconds a child has to import torch, load its model and say it is ready.
START_TIMEOUT_S = 120.0
#: Seconds a child has to exit once told to, before it is killed.
STOP_TIMEOUT_S = 10.0
#: Seconds between looks at whether a child still runs while its answer is awaited.
ANSWER_POLL_S = 0.05
#: Seconds before a child that could not be started is tried again; doubled
#: after each failure, up to RESTART_BACKOFF_MAX_S.
RESTART_BACKOFF_S = 1.0
RESTART_BACKOFF_MAX_S = 30.0
#: Seconds between a child's looks at whether its parent (the server) still runs.
PARENT_POLL_S = 0.5
#: Seconds between the server's looks at whether an idle child still runs.
WATCH_S = 0.5

Slots = Sequence[Mapping[str, torch.Tensor]]


def share_slots(slots: Slots) -> None:
    """Moves every staging tensor into shared memory (before the batcher is
    given their addresses: ``share_memory_`` moves the storage)."""
    for slot in slots:
        for t in slot.values():
            t.share_memory_()  # type: ignore[no-untyped-call]


def output_buffers(specs: Sequence[TensorSpec], max_batch_size: int) -> dict[str, torch.Tensor]:
    """One instance's outputs of one batch, in shared memory."""
    return {
        s.name: torch.empty((max_batch_size, *s.shape), dtype=s.torch_dtype).share_memory_()  # type: ignore[no-untyped-call]
        for s in specs
    }


def _picklable(exc: BaseException) -> BaseException:
    """``exc``, or a ``RuntimeError`` naming it when it cannot cross the pipe
    (rebuilt too: an exception whose ``__init__`` takes other arguments than
    it passes on pickles, but cannot be rebuilt from its pickle)."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except BaseException:  # noqa: BLE001 - any exception may fail to pickle (even with SystemExit)
        return RuntimeError(_describe(exc))


def _describe(exc: BaseException) -> str:
    """``exc``'s type and, if it can be formatted, its text."""
    try:
        return f"{type(exc).__name__}: {exc}"
    except BaseException:  # noqa: BLE001 - str() is the exception's own code
        return type(exc).__name__


def _send_answer(conn: multiprocessing.connection.Connection, answer: tuple[Any, ...]) -> None:
    """Sends ``answer``, pickled as the pipe pickles (torch's reductions: a
    tensor that plain pickle takes may be refused there); an error that
    cannot be sent goes as a ``RuntimeError`` naming it, so the child lives."""
    try:
        data = ForkingPickler.dumps(answer)
    except BaseException:  # noqa: BLE001 - pickling runs the exception's own code
        data = ForkingPickler.dumps(("error", RuntimeError(_describe(answer[1]))))
    conn.send_bytes(data)


def _child(
    conn: multiprocessing.connection.Connection,
    model: Any,
    inputs: Sequence[TensorSpec],
    outputs: Sequence[TensorSpec],
    slots: Slots,
    out: Mapping[str, torch.Tensor],
    torch_threads: int,
    cores: frozenset[int] | None,
    yields: bool,
    with_requests: bool,
) -> None:
    """An instance process: runs the batches its worker thread sends until
    told to stop or its parent is gone (``yields``: as a SCHED_BATCH process,
    as the server's worker threads run beside a native front-end)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the server's to act on
    if hasattr(signal, "pthread_sigmask"):  # blocked by the parent for the start: a pending one is dropped
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    _exit_with_parent()
    if cores is not None:
        os.sched_setaffinity(0, cores)
    if yields:
        yield_to_front_end()
    torch.set_num_threads(torch_threads)
    call: Any = model if with_requests else adapt_model(model, inputs, outputs)
    conn.send(("ready", os.getpid()))
    with model_mode():
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                return  # the server is gone
            if message[0] == "stop":
                return
            _, index, start, rows, requests = message
            answer: tuple[Any, ...] = ("ok",)
            try:
                views = {s.name: slots[index][s.name][start : start + rows] for s in inputs}
                try:
                    raw = call(views) if requests is None else call(views, requests)
                except RequestsFailed as failed:  # its outputs are checked as any
                    raw, answer = failed.outputs, ("partly", {i: _picklable(e) for i, e in failed.errors.items()})
                for name, t in normalize_outputs(raw, outputs, rows).items():
                    out[name][:rows].copy_(t)
            except BaseException as exc:  # noqa: BLE001 - even SystemExit: the instance survives
                answer = ("error", _picklable(exc))
            try:
                _send_answer(conn, answer)
            except (EOFError, OSError):
                return  # the server is gone


def _exit_with_parent() -> None:
    """Ends this process once its parent (the server) is gone, even while
    a batch runs (between batches the pipe's end says so too)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(0)

    threading.Thread(target=watch, name="ferrobatch-parent-watch", daemon=True).start()


@contextlib.contextmanager
def _sigint_blocked() -> Iterator[None]:
    """SIGINT blocked on this thread, so a child started meanwhile inherits
    it blocked (a terminal's Ctrl-C during its start-up is the server's, not
    a kill of the child); the child ignores it before unblocking."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


class ProcessExecutor(CpuExecutor):
    """A CPU instance whose model runs in a child process (see the module
    docstring); :meth:`run` sends a batch there and copies its outputs back,
    so the worker loop, failure isolation, the weight gate's version output
    and the counts are those of every CPU instance.

    The worker thread starts, replaces and talks to the child; :meth:`stop`
    comes from another thread, so the child and its pipe change hands under
    ``_lock``, and a child started after :meth:`stop` is killed at once."""

    def __init__(
        self,
        model: Any,
        index: int,
        server_name: str,
        inputs: Sequence[TensorSpec],
        outputs: Sequence[TensorSpec],
        max_batch_size: int,
    ) -> None:
        super().__init__(model, torch.device("cpu"), outputs)
        self.index = index
        self.server_name = server_name
        self.inputs = inputs
        self.max_batch_size = max_batch_size
        self._slots: Slots = ()
        self._slot_index: dict[int, int] = {}
        self._out: dict[str, torch.Tensor] = {}
        self._launch_args: tuple[Any, ...] = ()
        self._lock = threading.Lock()
        self._conn: multiprocessing.connection.Connection | None = None
        self._process: Any = None
        self._stopped = False
        #: A child being started (stop() kills it).
        self._starting: Any = None
        #: The server is draining its queue to stop: an instance without a process leaves it to the others.
        self._closing = False
        #: Set by closing() and stop(): a worker waiting to try a start again goes on.
        self._stopping = threading.Event()
        #: Why the last start failed (None: it did not), and when to try again.
        self._down: ModelError | None = None
        self._retry_at = 0.0
        self._backoff = RESTART_BACKOFF_S
        #: The server's process instances, this one included: while one of
        #: the others runs, an instance that cannot start leaves them its batches.
        self.peers: Sequence[ProcessExecutor] = ()
        #: Child processes that started for this instance and said they were
        #: ready (1, plus one per restart; a failed try is not counted).
        self.starts = 0
        #: Batches run again on a new process after theirs died (counted in retry_calls).
        self.reruns = 0
        #: Rows of the batch being served (a call on all of them may run again).
        self._batch_rows = 0
        #: Called (on the worker's or the retrying thread) when :attr:`down` changes.
        self.on_health_change: Callable[[], None] | None = None
        #: One start at a time: the worker's, or the retrying thread's.
        self._start_lock = threading.Lock()
        #: Tries starts again on their schedule while the instance is down
        #: and no batch asks (readiness says not ready meanwhile: none may come).
        self._retrying: threading.Thread | None = None
        #: A batch is being exchanged with the child: if it dies, the worker sees it.
        self._exchanging = False
        #: Held while a batch is on the child's pipe and in its output
        #: buffers: the instance's own, or another instance's without a process.
        self._pipe = threading.Lock()

    @property
    def pid(self) -> int | None:
        """The instance's process, while it runs."""
        process = self._process
        return None if process is None else int(process.pid)

    @property
    def up(self) -> bool:
        """Whether the instance has a process to run batches."""
        return self._conn is not None

    @property
    def down(self) -> bool:
        """Whether its process died and could not be started again (it
        tries again later): it runs no batch until then."""
        return self._down is not None and not self.up

    def launch(self, slots: Slots, torch_threads: int, cores: frozenset[int] | None, yields: bool = False) -> None:
        """Starts the child (slots shared already) and waits until it is ready."""
        self._slots = slots
        self._slot_index = {id(slot): i for i, slot in enumerate(slots)}
        self._out = output_buffers(self.outputs, self.max_batch_size)
        self._launch_args = (torch_threads, cores, yields)
        self._start_child()
        name = f"ferrobatch-{self.server_name}-{self.index}-watch"
        threading.Thread(target=self._watch, name=name, daemon=True).start()

    def _watch(self) -> None:
        """Replaces a child that died between batches once it is seen, not
        when the next batch comes for it (that batch would wait for the
        start, and readiness would say ready meanwhile). Asked of
        ``waitpid``: a process the model forked may hold the child's
        sentinel open. Ends when the server drains its queue or stops."""
        while not self._stopping.wait(WATCH_S):
            with self._lock:
                process = self._process
            if process is None or self._exchanging or process.is_alive():
                continue
            self._lost(process, "between batches")
            try:
                self._try_start()
            except Exception:  # this thread must not end while the server runs
                log.exception("ferrobatch: model '%s': instance %d: a restart failed", self.server_name, self.index)

    def _start_child(self) -> None:
        torch_threads, cores, yields = self._launch_args
        context = torch_mp.get_context("spawn")
        try:
            parent, child = context.Pipe()
        except OSError as exc:  # out of descriptors: as a failed start
            raise ModelError(f"model '{self.server_name}': instance {self.index}'s process: {exc}") from exc
        process = context.Process(
            target=_child,
            args=(
                child,
                self.model,
                self.inputs,
                self.outputs,
                self._slots,
                self._out,
                torch_threads,
                cores,
                yields,
                self.with_requests,
            ),
            name=f"ferrobatch-{self.server_name}-{self.index}",
            daemon=True,
        )
        try:
            with _sigint_blocked():
                process.start()
        except OSError as exc:  # out of processes or descriptors: as a failed start
            parent.close()
            child.close()
            raise ModelError(f"model '{self.server_name}': instance {self.index}'s process: {exc}") from exc
        except Exception as exc:  # pickling runs the model's own code (its __reduce__)
            parent.close()
            child.close()
            raise ModelError(
                f"model '{self.server_name}': instance_kind='process' sends the model to its process, and it"
                f" cannot be pickled: {type(exc).__name__}: {exc} (define it at a module's top level)"
            ) from exc
        child.close()
        with self._lock:
            self._starting = process  # stop() kills it, not waiting for its start
        try:
            outcome = self._await_start(parent, process)
        finally:
            with self._lock:
                self._starting = None
        with self._lock:
            if outcome == "ready" and not self._stopped:
                self._conn, self._process = parent, process
                self.starts += 1  # a try that failed is no start (nor a restart)
                return
        if outcome == "ended":  # it is exiting: its exit code is its own, not our kill's
            _wait_gone(process, STOP_TIMEOUT_S)
        _kill(process)
        parent.close()
        if self._stopped:
            raise ServerClosedError(f"server '{self.server_name}' stopped")
        if outcome == "ended":
            raise ModelError(
                f"model '{self.server_name}': instance {self.index}'s process exited at start"
                f" (exit code {process.exitcode}); its traceback is on its stderr (the server's):"
                " can it unpickle the model (is the model's module importable there)?"
            )
        raise ModelError(
            f"model '{self.server_name}': instance {self.index}'s process did not start in time"
            f" ({START_TIMEOUT_S:.0f} s)"
        )

    def _await_start(self, conn: multiprocessing.connection.Connection, process: Any) -> str:
        """How the child's start went: ``"ready"`` (it said so), ``"ended"``
        (it ended, or closed its pipe, first), ``"late"`` (not ready within
        START_TIMEOUT_S) or ``"stopped"`` (the server stopped meanwhile)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        if not _answered(conn, process, lambda: self._stopped or time.monotonic() > deadline):
            if self._stopped:
                return "stopped"
            return "ended" if not process.is_alive() else "late"
        try:
            conn.recv()
        except (EOFError, OSError):
            return "ended"
        return "ready"

    def _try_start(self) -> None:
        """Starts a child; a failure is remembered (``_down``) and the next
        try put off, longer after each. A change of :attr:`down` is told to
        ``on_health_change``."""
        with self._start_lock:
            if self.up:
                return  # the other thread started it meanwhile
            was_down = self.down
            try:
                self._try_start_once()
            finally:
                if self.down != was_down and self.on_health_change is not None:
                    self.on_health_change()
        if self.down:
            self._retry_in_background()

    def _retry_in_background(self) -> None:
        """Starts the thread that tries again on the schedule, unless one runs."""
        with self._lock:
            if self._stopped or (self._retrying is not None and self._retrying.is_alive()):
                return
            self._retrying = threading.Thread(
                target=self._retry_until_up, name=f"ferrobatch-{self.server_name}-{self.index}-restart", daemon=True
            )
            self._retrying.start()

    def _retry_until_up(self) -> None:
        while self.down and not self._stopped and not self._closing:
            wait = self._retry_at - time.monotonic()
            if wait > 0:
                self._stopping.wait(wait)
                continue
            try:
                self._try_start()
            except Exception:  # this thread is the instance's way back: it must not end
                log.exception("ferrobatch: model '%s': instance %d: a restart failed", self.server_name, self.index)
                self._stopping.wait(RESTART_BACKOFF_S)

    def _try_start_once(self) -> None:
        try:
            self._start_child()
        except ServerClosedError:
            return  # stopped meanwhile: the worker's loop ends
        except Exception as exc:  # noqa: BLE001 - whatever the start raised, the instance is down
            if not isinstance(exc, ModelError):
                wrapped = ModelError(f"model '{self.server_name}': instance {self.index}'s process: {exc!r}")
                wrapped.__cause__ = exc
                exc = wrapped
            self._down = exc
            self._retry_at = time.monotonic() + self._backoff
            log.error("ferrobatch: model '%s': instance %d could not be restarted (next try in %.0f s): %s",
                      self.server_name, self.index, self._backoff, exc)  # fmt: skip
            self._backoff = min(2 * self._backoff, RESTART_BACKOFF_MAX_S)
        else:
            self._down, self._backoff = None, RESTART_BACKOFF_S

    def ready_for_batch(self) -> bool:
        """While this instance has no process and another instance has one,
        waits to try a start again, leaving the batches to the others; False
        (its worker ends) if the server drains its queue meanwhile."""
        while not self.up and not self._stopped and any(p.up for p in self.peers if p is not self):
            if self._closing:
                return False
            wait = self._retry_at - time.monotonic()
            if wait > 0:
                self._stopping.wait(wait)
            else:
                self._try_start()
        return True

    def begin(self, batch: _core.Batch) -> None:
        super().begin(batch)
        self._batch_rows = batch.rows

    @property
    def may_wait(self) -> bool:
        return not self.up  # it waits in ready_for_batch while another instance runs

    def closing(self) -> None:
        """The server stops taking requests and drains its queue."""
        self._closing = True
        self._stopping.set()

    def _live(self) -> tuple[multiprocessing.connection.Connection, Any]:
        """The child and its pipe, started first if none runs (a child found
        dead between batches is replaced); :class:`InstanceDownError` when
        one cannot be started."""
        with self._lock:
            if self._stopped:
                raise ServerClosedError(f"server '{self.server_name}' stopped")
            conn, process = self._conn, self._process
        if conn is not None:
            if process.is_alive():
                return conn, process
            self._lost(process, "between batches")
        if time.monotonic() >= self._retry_at:
            self._try_start()
        with self._lock:
            conn, process = self._conn, self._process
        if conn is None:
            raise InstanceDownError(
                f"model '{self.server_name}': instance {self.index} has no process: {self._down}"
            ) from self._down
        return conn, process

    def run(self, slot: Mapping[str, torch.Tensor], rows: int, start: int = 0) -> dict[str, torch.Tensor]:
        """The outputs for ``rows`` rows of ``slot`` from ``start``, computed
        by the instance's process; once more on a new process if it died
        during the whole batch (with ``isolate_failures``; a part of a batch
        being isolated is not: a request that kills its process would cost
        two restarts per part). When this instance has no process and none
        can be started (a batch it took before it saw its process gone), the
        batch runs on another instance's process, if one runs (the staging
        slots are every process's)."""
        requests = self.requests_of(start, rows)
        message = ("run", self._slot_index[id(slot)], start, rows, requests)
        try:
            with self._pipe:
                return self._outputs(self._exchange_or_rerun(message, start, rows), start, rows, requests)
        except InstanceDownError:
            peer = next((p for p in self.peers if p is not self and p.up), None)
            if peer is None:
                raise
            log.warning("ferrobatch: model '%s': instance %d has no process: its batch runs on instance %d's",
                        self.server_name, self.index, peer.index)  # fmt: skip
            with peer._pipe:  # not under this instance's own: no two are ever held
                return peer._outputs(peer._exchange(message), start, rows, requests)

    def _exchange_or_rerun(self, message: tuple[Any, ...], start: int, rows: int) -> tuple[Any, ...]:
        try:
            return self._exchange(message)
        except _DiedError:
            whole = start == 0 and rows == self._batch_rows
            if not self.isolate_failures or self._stopped or not whole:
                raise
            log.warning("ferrobatch: model '%s': the batch runs again on instance %d's new process",
                        self.server_name, self.index)  # fmt: skip
            return self._exchange(message, rerun=True)

    def _outputs(
        self, answer: tuple[Any, ...], start: int, rows: int, requests: Sequence[RequestInfo] | None
    ) -> dict[str, torch.Tensor]:
        """The outputs an answer left in this instance's buffers (under
        ``_pipe``); for a call that failed some of its ``requests``, raised
        as a thread instance raises them."""
        if answer[0] == "error":
            raise answer[1]
        # Copied out: the next batch on this process rewrites the buffers.
        outputs = {name: t[:rows].clone() for name, t in self._out.items()}
        if answer[0] == "partly":
            raise RequestsFailed(outputs, answer[1]).answered(outputs, start, requests)
        return outputs

    def _exchange(self, message: tuple[Any, ...], rerun: bool = False) -> tuple[Any, ...]:
        """Sends ``message`` to the child and returns its answer;
        :class:`_DiedError` if the child ended first. ``rerun``: a batch run
        again, counted once a process has it."""
        conn, process = self._live()
        self._exchanging = True
        try:
            conn.send(message)
            self.reruns += rerun
            if not _answered(conn, process, lambda: False):
                raise EOFError("the process ended")
            data = conn.recv_bytes()
        except (EOFError, OSError) as exc:
            what = self._lost(process, "during the batch")
            raise _DiedError(f"model '{self.server_name}': instance {self.index}'s process {what}") from exc
        finally:
            self._exchanging = False
        try:
            answer: tuple[Any, ...] = ForkingPickler.loads(data)
        except Exception as exc:  # the model's exception, which cannot be rebuilt here
            raise ModelError(
                f"model '{self.server_name}' raised an exception that could not be rebuilt here: {exc!r}"
            ) from exc
        return answer

    def _lost(self, process: Any, when: str) -> str:
        """Forgets a child whose pipe failed, killing it if it still runs,
        and reaps it; says what happened (logged once, by the thread that
        forgot it: the worker or the watcher)."""
        with self._lock:
            forgot = self._process is process
            if forgot:
                self._conn, self._process = None, None
        _kill(process)  # if it still runs, its pipe failed: it cannot be trusted with another batch
        what = f"(pid {process.pid}) died (exit code {process.exitcode}) {when}"
        if forgot and not self._stopped:
            log.error("ferrobatch: model '%s': instance %d's process %s; starting another",
                      self.server_name, self.index, what)  # fmt: skip
        return what

    def stop(self, wait: bool = True) -> None:
        """Tells the child to stop and reaps it (killed if it does not go
        within ``STOP_TIMEOUT_S``); without ``wait`` (the server's stop
        timed out, a batch may still be running there) killed at once.
        Idempotent; no child is started after it."""
        with self._lock:
            self._stopped = True
            conn, process, self._conn, self._process = self._conn, self._process, None, None
            starting = self._starting
        self._stopping.set()
        if starting is not None:
            _kill(starting)
        if process is None:
            return
        if wait and conn is not None:
            try:
                conn.send(("stop",))
            except (EOFError, OSError):
                pass
            _wait_gone(process, STOP_TIMEOUT_S)
        _kill(process)


def _answered(conn: multiprocessing.connection.Connection, process: Any, give_up: Callable[[], bool]) -> bool:
    """Whether ``conn`` has the child's answer to read; False once the child
    has ended (asked of ``waitpid``: a process it forked may keep the pipe,
    and its sentinel, open) or ``give_up()`` says so."""
    while not conn.poll(ANSWER_POLL_S):
        if not process.is_alive() or give_up():
            return False
    return True


def _wait_gone(process: Any, seconds: float) -> bool:
    """Whether ``process`` ended within ``seconds``, asked by ``waitpid``:
    ``join`` waits on a pipe that a process the model forked may hold open."""
    deadline = time.monotonic() + seconds
    while process.is_alive():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _kill(process: Any) -> None:
    """Kills ``process`` if it still runs, and reaps it."""
    if process.is_alive():
        process.kill()
    _wait_gone(process, STOP_TIMEOUT_S)


class _DiedError(ModelError):
    """The child ended during a batch (which may run once more on a new one)."""
