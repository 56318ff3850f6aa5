"""Model instances as processes (``Server(instance_kind="process")``): each
instance's model runs in a child process of its own, past the GIL, fed by a
worker thread of the server like any instance.

The staging slots and each instance's output buffers are shared memory
(``share_memory_``, before the batcher writes into them), mapped by the
children once at start: a batch crosses the process boundary as a slot
index and a row range on a pipe (``("run", slot, start, rows, requests)``),
its outputs come back in the instance's output buffers, copied out by the
worker thread before the next batch can overwrite them. A child that
raises answers ``("error", exception)``; a child that dies (``kill -9``)
fails the batch it held and is started again, so failure isolation retries
that batch's requests on the new process. A child whose parent is gone
reads end-of-file on its pipe and exits.

Fixed-shape tensors only; the model must be picklable (``spawn``).
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import pickle
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.multiprocessing as torch_mp

from ._executor import yield_to_front_end
from ._torch import CpuExecutor, adapt_model, inference_mode, normalize_outputs
from .errors import ModelError
from .specs import TensorSpec

log = logging.getLogger("ferrobatch")

#: Seconds a child has to import torch, load its model and say it is ready.
START_TIMEOUT_S = 120.0
#: Seconds a child has to exit once told to, before it is killed.
STOP_TIMEOUT_S = 10.0

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
    """``exc``, or a ``RuntimeError`` naming it when it cannot cross the pipe."""
    try:
        pickle.dumps(exc)
        return exc
    except Exception:  # noqa: BLE001 - any exception may fail to pickle (or to format)
        try:
            text = f"{type(exc).__name__}: {exc}"
        except Exception:  # noqa: BLE001
            text = type(exc).__name__
        return RuntimeError(text)


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
    if cores is not None:
        os.sched_setaffinity(0, cores)
    if yields:
        yield_to_front_end()
    torch.set_num_threads(torch_threads)
    call: Any = model if with_requests else adapt_model(model, inputs, outputs)
    conn.send(("ready", os.getpid()))
    with inference_mode():
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                return  # the server is gone
            if message[0] == "stop":
                return
            _, index, start, rows, requests = message
            try:
                views = {s.name: slots[index][s.name][start : start + rows] for s in inputs}
                raw = call(views) if requests is None else call(views, requests)
                for name, t in normalize_outputs(raw, outputs, rows).items():
                    out[name][:rows].copy_(t)
                answer: tuple[Any, ...] = ("ok",)
            except BaseException as exc:  # noqa: BLE001 - even SystemExit: the instance survives
                answer = ("error", _picklable(exc))
            conn.send(answer)


class ProcessExecutor(CpuExecutor):
    """A CPU instance whose model runs in a child process (see the module
    docstring); :meth:`run` sends a batch there and copies its outputs back,
    so the worker loop, failure isolation, the weight gate's version output
    and the counts are those of every CPU instance."""

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
        self._conn: multiprocessing.connection.Connection | None = None
        self._process: Any = None
        #: Child processes started for this instance (1, plus one per restart).
        self.starts = 0

    @property
    def pid(self) -> int | None:
        """The instance's process, while it runs."""
        return None if self._process is None else int(self._process.pid)

    def launch(self, slots: Slots, torch_threads: int, cores: frozenset[int] | None, yields: bool = False) -> None:
        """Starts the child (slots shared already) and waits until it is ready."""
        self._slots = slots
        self._slot_index = {id(slot): i for i, slot in enumerate(slots)}
        self._out = output_buffers(self.outputs, self.max_batch_size)
        self._launch_args = (torch_threads, cores, yields)
        self._start_child()

    def _start_child(self) -> None:
        torch_threads, cores, yields = self._launch_args
        context = torch_mp.get_context("spawn")
        parent, child = context.Pipe()
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
            process.start()
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            parent.close()
            child.close()
            raise ModelError(
                f"model '{self.server_name}': instance_kind='process' sends the model to its process, and it"
                f" cannot be pickled: {exc} (define it at a module's top level)"
            ) from exc
        child.close()
        self.starts += 1
        if not parent.poll(START_TIMEOUT_S):
            process.kill()
            process.join()
            raise ModelError(f"model '{self.server_name}': instance {self.index}'s process did not start in time")
        try:
            parent.recv()
        except (EOFError, OSError) as exc:
            process.join()
            raise ModelError(
                f"model '{self.server_name}': instance {self.index}'s process exited at start"
                f" (exit code {process.exitcode}); is the model picklable?"
            ) from exc
        self._conn, self._process = parent, process

    def run(self, slot: Mapping[str, torch.Tensor], rows: int, start: int = 0) -> dict[str, torch.Tensor]:
        """The outputs for ``rows`` rows of ``slot`` from ``start``, computed
        by the instance's process."""
        conn = self._conn
        if conn is None:
            raise ModelError(f"model '{self.server_name}': instance {self.index} has no process")
        requests = self.requests_of(start, rows)
        try:
            conn.send(("run", self._slot_index[id(slot)], start, rows, requests))
            answer = conn.recv()
        except (EOFError, OSError) as exc:
            died = self._restart()
            raise ModelError(f"model '{self.server_name}': instance {self.index}'s process {died}") from exc
        if answer[0] == "error":
            raise answer[1]
        # Copied out: the next batch of this instance rewrites the buffers.
        return {name: t[:rows].clone() for name, t in self._out.items()}

    def _restart(self) -> str:
        """Reaps the dead child and starts another; says what happened."""
        process, self._conn, self._process = self._process, None, None
        process.join(STOP_TIMEOUT_S)
        what = f"(pid {process.pid}) died (exit code {process.exitcode}) during the batch"
        log.error("ferrobatch: model '%s': instance %d's process %s; starting another", self.server_name,
                  self.index, what)  # fmt: skip
        try:
            self._start_child()
        except ModelError:
            log.exception("ferrobatch: model '%s': instance %d could not be restarted", self.server_name, self.index)
        return what

    def stop(self) -> None:
        """Tells the child to stop, and reaps it (killed if it does not go)."""
        conn, process, self._conn, self._process = self._conn, self._process, None, None
        if process is None:
            return
        try:
            if conn is not None:
                conn.send(("stop",))
        except (EOFError, OSError):
            pass
        process.join(STOP_TIMEOUT_S)
        if process.is_alive():
            process.kill()
            process.join()
