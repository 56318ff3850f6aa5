"""ferrobatch.torchrl: TorchRL's InferenceServer contract on ferrobatch's core
(TorchRL's documented signature, lifecycle, stats keys, versions stamped into
results, update_model / update_policy_weights_ / a polled weight_sync scheme,
collate_fn, the model's own exceptions, threads and spawned processes)."""

from __future__ import annotations

import inspect
import multiprocessing
import os
import sys
import threading
import time
from concurrent.futures import Future
from typing import Any

import pytest
import torch

import ferrobatch as fb

pytest.importorskip("tensordict")
from tensordict import TensorDict
from tensordict.nn import TensorDictModule

from ferrobatch.torchrl import InferenceServer, MPTransport, ThreadingTransport

pytestmark = pytest.mark.timeout(60)


def policy() -> TensorDictModule:
    torch.manual_seed(0)
    return TensorDictModule(torch.nn.Linear(4, 2), in_keys=["observation"], out_keys=["action"])


def request(i: float = 1.0) -> TensorDict:
    return TensorDict({"observation": torch.full((4,), i), "reward": torch.zeros(1)})


def test_the_seed_contract_of_torchrl_holds() -> None:
    params = list(inspect.signature(InferenceServer).parameters)
    assert params[:2] == ["model", "transport"]
    for name in ("max_batch_size", "min_batch_size", "timeout", "collate_fn", "device", "weight_sync",
                 "weight_sync_model_id", "policy_version", "policy_version_key", "output_device"):  # fmt: skip
        assert name in params
    defaults = inspect.signature(InferenceServer).parameters
    # None, as TorchRL's: 64 and 0.01 unless server_config= gives them (the two exclude each other).
    assert defaults["max_batch_size"].default is None and defaults["timeout"].default is None
    transport = ThreadingTransport()
    server = InferenceServer(policy(), transport, max_batch_size=8)
    assert not server.is_alive
    assert server.start() is server and server.is_alive
    server.shutdown(timeout=5.0)
    assert not server.is_alive


def test_threads_get_their_own_rows_batched_with_the_version_stamped() -> None:
    module = policy()
    transport = ThreadingTransport()
    results: dict[int, Any] = {}
    with InferenceServer(module, transport, max_batch_size=16) as server:
        client = transport.client()
        barrier = threading.Barrier(16)

        def actor(i: int) -> None:
            barrier.wait()
            results[i] = [client(request(i + k / 10)) for k in range(20)]

        threads = [threading.Thread(target=actor, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        stats = server.stats()
    for i, outs in results.items():
        for k, out in enumerate(outs):
            obs = torch.full((4,), i + k / 10)
            assert torch.equal(out["observation"], obs) and "reward" in out.keys()
            with torch.no_grad():
                torch.testing.assert_close(out["action"], module.module(obs))
            assert int(out["policy_version"]) == 0
    assert len(results) == 16
    for key in ("requests", "batches", "avg_batch_size", "policy_version", "weight_updates"):
        assert key in stats
    assert stats["requests"] == 320 and stats["avg_batch_size"] > 1.0


def test_a_model_error_reaches_the_client_as_itself() -> None:
    def broken(td: TensorDict) -> TensorDict:
        if bool((td["observation"] < 0).any()):
            raise ValueError("negative observation")
        return td.set("action", td["observation"] * 2)

    transport = ThreadingTransport()
    with InferenceServer(broken, transport, max_batch_size=4):
        client = transport.client()
        assert torch.equal(client(request(1.0))["action"], torch.full((4,), 2.0))
        with pytest.raises(ValueError, match="negative observation"):
            client(request(-1.0))
        with pytest.raises(ValueError, match="negative observation"):
            client.submit(request(-1.0)).result(10)
        assert torch.equal(client(request(3.0))["action"], torch.full((4,), 6.0))


async def test_the_core_api_keeps_model_error_with_its_cause() -> None:
    def broken(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        raise ValueError("bad batch")

    server = fb.Server(
        broken, inputs=[fb.TensorSpec("x", "float32", (4,))], outputs=[fb.TensorSpec("y", "float32", (4,))]
    )
    async with server:
        with pytest.raises(fb.ModelError) as info:
            await server.client().infer({"x": torch.zeros(4)})
    assert isinstance(info.value.__cause__, ValueError)


def test_update_model_and_update_policy_weights_bump_the_stamped_version() -> None:
    module = policy()
    transport = ThreadingTransport()
    with InferenceServer(module, transport, max_batch_size=4, policy_version=5) as server:
        client = transport.client()
        assert int(client(request())["policy_version"]) == 5
        assert server.update_model(lambda m: m.module.weight.zero_() is not None) is True
        assert server.policy_version == 6
        out = client(request())
        assert int(out["policy_version"]) == 6
        torch.testing.assert_close(out["action"], module.module.bias.detach())
        server.update_model(lambda m: None, mark_weight_update=False)
        assert server.policy_version == 6
        server.update_policy_weights_()
        ones = {k: torch.ones_like(v) for k, v in module.state_dict().items()}
        server.update_policy_weights_(policy_or_weights=ones)
        out = client.submit(request()).result(10)
        stats = server.stats()
    assert int(out["policy_version"]) == 8 == stats["policy_version"]
    assert stats["weight_updates"] == 3
    assert torch.equal(out["action"], torch.full((2,), 5.0))  # 4 ones + bias 1


def test_no_version_key_stamps_nothing_and_collate_fn_is_honoured() -> None:
    seen: list[int] = []

    def collate(items: list[TensorDict]) -> TensorDict:
        seen.append(len(items))
        return torch.stack(items)

    transport = ThreadingTransport()
    with InferenceServer(policy(), transport, collate_fn=collate, policy_version_key=None):
        out = transport.client()(request())
    assert "policy_version" not in out.keys() and "action" in out.keys()
    assert seen and all(n >= 1 for n in seen)


def test_collate_fn_sees_each_request_whole_and_its_failure_is_that_requests() -> None:
    seen: list[set[str]] = []

    def fragile(items: list[TensorDict]) -> TensorDict:
        seen.extend(set(item.keys()) for item in items)
        if any("poison" in item.keys() for item in items):
            raise ValueError("cannot collate a poisoned batch")
        return torch.stack(items)

    transport = ThreadingTransport()
    with InferenceServer(policy(), transport, max_batch_size=1, collate_fn=fragile) as server:
        client = transport.client()
        bad = TensorDict({"observation": torch.ones(4), "poison": torch.ones(1)})
        with pytest.raises(ValueError, match="poisoned"):
            client(bad)  # the first request, whose model call (collated) learns the specs
        assert client(request())["action"].shape == (2,)  # the first answered: its keys fix what travels
        assert client(TensorDict({"observation": torch.ones(4)}))["action"].shape == (2,)  # one without "reward"
        assert server.is_alive
    assert seen[0] == {"observation", "poison"}
    assert seen[-1] == {"observation"}  # collated without what it did not carry


class FakeScheme:
    """The receiver side of a torchrl.weight_update scheme: receive() applies
    what the trainer sent (here: a number added to the bias) and returns it."""

    context: Any = None
    initialized_on_receiver = False
    synchronized_on_receiver = False

    def __init__(self) -> None:
        self.sent: list[float] = []
        self.model: Any = None

    def init_on_receiver(self, *, model_id: str, model: Any, worker_idx: int) -> None:
        self.model, self.initialized_on_receiver = model, True

    def connect(self, *, worker_idx: int) -> None:
        self.synchronized_on_receiver = True

    def receive(self, timeout: float = 0.0) -> Any:
        if not self.sent:
            return None
        value = self.sent.pop()
        with torch.no_grad():
            self.model.module.bias.add_(value)
        return value


def test_a_weight_sync_scheme_is_polled_between_batches() -> None:
    scheme = FakeScheme()
    transport = ThreadingTransport()
    with InferenceServer(policy(), transport, weight_sync=scheme, timeout=0.005) as server:
        client = transport.client()
        before = client(request(0.0))
        scheme.sent.append(1.0)
        for _ in range(400):
            if server.policy_version == 1:
                break
            threading.Event().wait(0.005)
        after = client(request(0.0))
    assert scheme.initialized_on_receiver and scheme.synchronized_on_receiver
    assert int(after["policy_version"]) == 1 and server.stats()["weight_updates"] == 1
    torch.testing.assert_close(after["action"], before["action"] + 1)


def _mp_actor(client: Any, results: Any) -> None:
    outs = [client(TensorDict({"observation": torch.full((4,), float(i))})) for i in range(3)]
    future: Future[Any] = client.submit(TensorDict({"observation": torch.full((4,), -1.0)}))
    try:
        future.result(30)
        error = "no error"
    except ValueError as exc:
        error = str(exc)
    results.put(([o["action"].tolist() for o in outs], [int(o["policy_version"]) for o in outs], error))


def test_mp_transport_clients_work_in_spawned_processes() -> None:
    module = policy()

    def model(td: TensorDict) -> TensorDict:
        if bool((td["observation"] < 0).any()):
            raise ValueError("negative observation")
        return module(td)

    ctx = multiprocessing.get_context("spawn")
    transport = MPTransport(ctx=ctx)
    with InferenceServer(model, transport, max_batch_size=4):
        results = ctx.Queue()
        process = ctx.Process(target=_mp_actor, args=(transport.client(), results))
        process.start()
        actions, versions, error = results.get(timeout=45)
        process.join(15)
    assert process.exitcode == 0
    with torch.no_grad():
        for i, action in enumerate(actions):
            torch.testing.assert_close(torch.tensor(action), module.module(torch.full((4,), float(i))))
    assert versions == [0, 0, 0]
    assert error == "negative observation"


# -- batched requests, and MPTransport's clients when something breaks --------------------------


@pytest.mark.parametrize("transport_type", [ThreadingTransport, MPTransport])
def test_a_batched_request_gets_its_rows_and_one_version_per_row(transport_type: type) -> None:
    module = policy()
    seen: list[torch.Size] = []

    def model(td: TensorDict) -> TensorDict:
        seen.append(td.batch_size)
        return module(td)

    transport = transport_type()
    with InferenceServer(model, transport, max_batch_size=4, policy_version=2):
        client = transport.client()  # an MPTransport client works in this process too
        observation = torch.randn(3, 4)
        out = client.submit(TensorDict({"observation": observation}, batch_size=[3])).result(10)
    assert out.batch_size == torch.Size([3])
    with torch.no_grad():
        torch.testing.assert_close(out["action"], module.module(observation))
    assert torch.equal(out["policy_version"], torch.full((3,), 2))
    assert seen and all(size[1:] == torch.Size([3]) for size in seen)  # stacked as TorchRL does


def test_an_mp_client_rides_shared_memory_once_the_server_shares_itself() -> None:
    """The first request (through the pipe) fixes the specs and the server
    shares itself; the client's next requests go through shared memory, with
    the same results, versions and the model's own exceptions (fetched over
    the pipe), blocking or as futures; a stopped server fails them."""
    module = policy()

    def model(td: TensorDict) -> TensorDict:
        if bool((td["observation"] < 0).any()):
            raise KeyError("negative observation")
        return module(td)

    transport = MPTransport()
    client = transport.client()
    server = InferenceServer(model, transport, max_batch_size=8, policy_version=5).start()
    try:
        client(request(1.0))  # through the pipe: the specs are learnt from it
        shared = server._core._shared[0]  # type: ignore[union-attr]
        assert shared.name == transport.shm_name
        deadline = time.monotonic() + 10
        while os.getpid() not in [pid for _, pid in shared.clients()]:
            assert time.monotonic() < deadline, "the client never joined the share"
            client(request(1.0))
        served = server.stats()["requests"]
        out = client(request(2.0))
        futures = [client.submit(request(float(i))) for i in range(16)]
        with torch.no_grad():
            torch.testing.assert_close(out["action"], module.module(torch.full((4,), 2.0)))
            for i, future in enumerate(futures):
                result = future.result(10)
                torch.testing.assert_close(result["action"], module.module(torch.full((4,), float(i))))
                assert int(result["policy_version"]) == 5
        assert int(out["policy_version"]) == 5
        with pytest.raises(KeyError, match="negative observation"):
            client(request(-1.0))
        with pytest.raises(KeyError, match="negative observation"):
            client.submit(request(-1.0)).result(10)
        assert server.stats()["requests"] == served + 19
        assert shared.in_flight == 0 and client._route is not None
    finally:
        server.shutdown()
    with pytest.raises(fb.ServerClosedError):
        client(request(1.0))


class BrokenPipe:
    """A client's end of its pipe whose reads fail (a corrupt stream)."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def send(self, message: Any) -> None:
        self.conn.send(message)

    def recv(self) -> Any:
        raise RuntimeError("corrupt stream")


def test_an_mp_client_whose_reader_fails_fails_its_waiting_and_later_requests() -> None:
    transport = MPTransport()
    with InferenceServer(policy(), transport, max_batch_size=4):
        client = transport.client()
        client._conn = BrokenPipe(client._conn)
        with pytest.raises(fb.ServerClosedError, match="RuntimeError: corrupt stream"):
            client.submit(request()).result(10)
        with pytest.raises(fb.ServerClosedError, match="corrupt stream"):
            client.submit(request()).result(10)


class Picky(Exception):
    """An exception pickle cannot rebuild (its constructor takes two arguments)."""

    def __init__(self, a: int, b: int) -> None:
        super().__init__(f"{a} {b}")


def test_an_mp_answer_the_client_cannot_rebuild_fails_that_request_alone() -> None:
    module = policy()

    def model(td: TensorDict) -> TensorDict:
        if bool((td["observation"] < 0).any()):
            raise Picky(1, 2)
        return module(td)

    transport = MPTransport()
    with InferenceServer(model, transport, max_batch_size=4):
        client = transport.client()
        with pytest.raises(fb.ModelError, match="cannot rebuild"):
            client.submit(request(-1.0)).result(10)
        out = client.submit(request(1.0)).result(10)
    with torch.no_grad():
        torch.testing.assert_close(out["action"], module.module(torch.full((4,), 1.0)))


def test_mp_clients_get_server_closed_after_shutdown() -> None:
    transport = MPTransport()
    server = InferenceServer(policy(), transport, max_batch_size=4).start()
    client = transport.client()
    assert "action" in client.submit(request()).result(10).keys()
    server.shutdown()
    with pytest.raises(fb.ServerClosedError):
        client.submit(request()).result(10)


def test_a_server_started_again_after_shutdown_serves_again() -> None:
    # start() -> shutdown() -> start() said is_alive and refused every request.
    module = policy()
    transport = ThreadingTransport()
    server = InferenceServer(module, transport, max_batch_size=4)
    client = transport.client()
    for round in range(3):
        server.start()
        assert server.is_alive
        if round == 1:
            server.update_model(lambda m: None)
        out = client(request(float(round)))
        torch.testing.assert_close(out["action"], module(request(float(round)))["action"])
        assert int(out["policy_version"]) == (0 if round == 0 else 1), "the version carries over"
        server.shutdown()
        assert not server.is_alive
    waiting = client.submit(request())  # as TorchRL's: it waits for the next start
    time.sleep(0.05)
    assert not waiting.done()
    with server:
        assert waiting.result(10)["action"].shape == (2,)


class QueueTransport:
    """A custom transport written against TorchRL's ``InferenceTransport``
    interface (``submit``/``drain``/``wait_for_work``/``resolve``), as
    TorchRL users write them: ferrobatch serves it as it is."""

    def __init__(self) -> None:
        self.queue: list[tuple[TensorDict, Future[Any]]] = []
        self.lock = threading.Lock()
        self.work = threading.Event()

    def submit(self, td: TensorDict) -> Future[Any]:
        future: Future[Any] = Future()
        with self.lock:
            self.queue.append((td, future))
        self.work.set()
        return future

    def drain(self, max_items: int) -> tuple[list[TensorDict], list[Future[Any]]]:
        with self.lock:
            taken, self.queue = self.queue[:max_items], self.queue[max_items:]
        return [td for td, _ in taken], [f for _, f in taken]

    def wait_for_work(self, timeout: float) -> None:
        self.work.wait(timeout)
        self.work.clear()

    def resolve(self, future: Future[Any], result: Any) -> None:
        future.set_result(result)

    def resolve_exception(self, future: Future[Any], error: BaseException) -> None:
        future.set_exception(error)


def test_a_custom_inference_transport_is_drained_into_ferrobatchs_batches() -> None:
    transport = QueueTransport()
    early = [transport.submit(request(float(i))) for i in range(6)]  # queued before the server starts
    seen: list[int] = []

    def collate(items: list[TensorDict]) -> TensorDict:
        seen.append(len(items))
        return torch.stack(items)

    with InferenceServer(policy(), transport, max_batch_size=4, collate_fn=collate) as server:
        assert server.transport_kind == "custom"
        results = [f.result(timeout=10) for f in early]
        late = transport.submit(request(9.0)).result(timeout=10)
    assert all(r["action"].shape == (2,) for r in [*results, late])
    assert sum(seen) == 7 and max(seen) <= 4, seen  # collate_fn sees requests only, never a probe
    assert results[3]["observation"][0] == 3  # each caller its own request back


def test_threading_transport_submit_before_start_and_the_stats_percentiles() -> None:
    transport = ThreadingTransport()
    held = [transport.submit(request(float(i))) for i in range(3)]
    with InferenceServer(policy_factory=policy, transport="auto", policy_device="cpu") as server:
        assert (server.service_backend, server.transport_kind) == ("thread", "thread")
    with pytest.raises(ValueError, match="incompatible"):
        InferenceServer(policy(), "ray")
    with InferenceServer(policy(), transport, max_batch_size=8) as server:
        assert [f.result(timeout=10)["observation"][0].item() for f in held] == [0, 1, 2]
        client = transport.client()
        for i in range(5):
            client(request(float(i)))
        stats = server.stats(reset=True)
        assert stats["requests"] == 8
        for key in ("p50_queue_ms", "p95_queue_ms", "p50_forward_ms", "p95_forward_ms"):
            assert stats[key] > 0, key
        assert stats["p95_forward_ms"] >= stats["p50_forward_ms"]
        assert server.stats()["requests"] == 0  # counted again from the reset
    waiting = transport.submit(request(7.0))  # between runs: it waits for the next start, as in TorchRL
    assert not waiting.done()
    with server:  # started again
        assert waiting.result(timeout=10)["observation"][0] == 7


def test_mp_transport_takes_torchrls_arguments_and_closes_its_clients() -> None:
    transport = MPTransport(ctx="spawn", use_manager=True)
    client = transport.client()
    with InferenceServer(policy(), transport, max_batch_size=4):
        assert client(request())["action"].shape == (2,)
        transport.close()  # TorchRL's: every client's connection ends
        with pytest.raises(fb.ServerClosedError):
            client(request())


def test_server_and_device_configs_as_torchrl_gives_them() -> None:
    from torchrl.modules.inference_server import InferenceDeviceConfig, InferenceServerConfig

    transport = ThreadingTransport()
    config = InferenceServerConfig(max_batch_size=2, timeout=0.001)
    devices = InferenceDeviceConfig(policy_device="cpu", env_device="cpu")
    with InferenceServer(policy(), transport, server_config=config, device_config=devices) as server:
        assert (server.max_batch_size, server.timeout) == (2, 0.001)
        assert server.policy_device == server.output_device == torch.device("cpu")  # output: the env's
        assert transport.client()(request())["action"].shape == (2,)
    with pytest.raises(ValueError, match="mutually exclusive"):
        InferenceServer(policy(), ThreadingTransport(), max_batch_size=64, server_config=config)
    with pytest.raises(ValueError, match="storing_device is a collector-level"):
        InferenceServer(policy(), ThreadingTransport(), device_config=InferenceDeviceConfig(storing_device="cpu"))


def _counting_policy() -> TensorDictModule:
    return policy()


def test_a_process_inference_server_serves_from_a_child_and_its_death_fails_its_clients() -> None:
    from ferrobatch.torchrl import ProcessInferenceServer

    transport = MPTransport(ctx="spawn")
    early = transport.client()  # made before the child exists
    server = ProcessInferenceServer(_counting_policy, transport, max_batch_size=4, mp_context="spawn")
    server.start()
    try:
        late = server.client()  # made after: its end is sent to the child
        assert early(request())["action"].shape == (2,)
        assert late(request(2.0))["action"].shape == (2,)
        assert server.stats(reset=True)["requests"] == 2 and server.stats()["requests"] == 0
        assert server.health()["process_alive"]
        with pytest.raises(RuntimeError, match="Unknown process-server verb"):
            server._request_control("bogus")
        for _ in range(3):  # the child shared itself once it knew its specs: the clients join it
            assert late(request(3.0))["action"].shape == (2,)
            time.sleep(0.06)
        assert late._route is not None
        pid = server._process.pid
        server._process.kill()
        server._process.join(10)
        with pytest.raises(fb.ServerClosedError, match="peer closed") as closed:
            early(request())  # the pipe ends with the child: no hang
        if _has_torchrl():  # also what TorchRL's own clients raise then
            from torchrl._comm.mailbox import MailboxPeerClosedError

            assert isinstance(closed.value, MailboxPeerClosedError)
    finally:
        server.shutdown(timeout=1.0)
    assert not server.is_alive and not server.health()["process_alive"]
    with pytest.raises(RuntimeError, match="not running"):
        server.stats()
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # reaped: no zombie of ours left


def test_the_process_service_backend_runs_the_server_in_a_child() -> None:
    server = InferenceServer(
        policy_factory=_counting_policy, service_backend="process", service_backend_options={"mp_context": "spawn"}
    )
    assert (server.service_backend, server.transport_kind) == ("process", "process")
    with server:
        assert server.is_alive
        assert server.client()(request())["action"].shape == (2,)
        assert server.stats()["requests"] == 1
        with pytest.raises(RuntimeError, match="lives in its child process"):
            server.update_model(lambda m: None)
    assert not server.is_alive
    with pytest.raises(ValueError, match="give policy_factory"):
        InferenceServer(policy(), service_backend="process")


def test_the_distributed_transport_feeds_a_process_server_its_pairs_and_tells_them_it_stopped() -> None:
    pytest.importorskip("torchrl")
    import time

    import torch.distributed as dist
    from torchrl._comm.mailbox import MailboxPeerClosedError, MailboxTransportError

    with pytest.raises(ValueError, match="requires request_spec and response_spec"):
        InferenceServer(policy_factory=policy, service_backend="process", transport="distributed")
    response = TensorDict({"action": torch.zeros(2), "policy_version": torch.zeros((), dtype=torch.long)})
    server = InferenceServer(
        policy_factory=policy,
        service_backend="process",
        service_backend_options={"mp_context": "spawn"},
        transport="distributed",
        transport_options={"backend": "gloo", "timeout": 30.0},
        request_spec=TensorDict({"observation": torch.zeros(4)}),
        response_spec=response,
    )
    assert (server.service_backend, server.transport_kind) == ("process", "distributed")
    first = server.client()  # made before the child starts
    with server:
        second = server.client()
        expected = policy()
        for i, client in enumerate([first, second, first]):
            td = TensorDict({"observation": torch.full((4,), float(i))})
            out = client(td, timeout=30.0)
            torch.testing.assert_close(out["action"], expected(td.clone())["action"])
            assert int(out["policy_version"]) == 0
        assert server.stats()["requests"] == 3  # batched by the child's ferrobatch core
        assert not dist.is_initialized()  # the default process group stays the caller's
    started = time.monotonic()
    with pytest.raises((MailboxPeerClosedError, MailboxTransportError)):
        first(TensorDict({"observation": torch.zeros(4)}), timeout=5.0)
    assert time.monotonic() - started < 3.0


@pytest.fixture
def ray_cluster(ray_session: Any) -> Any:
    """The run's Ray cluster; this module's policy factory travels to actors by value."""
    pytest.importorskip("ray.cloudpickle").register_pickle_by_value(sys.modules[__name__])
    return ray_session


@pytest.mark.ray
@pytest.mark.timeout(180)
def test_the_distributed_transport_to_a_ray_actor_learns_its_layout_from_the_first_request(ray_cluster: Any) -> None:
    pytest.importorskip("torchrl")
    from torchrl._comm.mailbox import MailboxPeerClosedError, MailboxTransportError

    server = InferenceServer(
        policy_factory=policy,
        service_backend="ray",
        service_backend_options={"remote_config": {"num_cpus": 0}},
        transport="distributed",
        transport_options={"backend": "gloo", "timeout": 30.0},
    )
    try:
        assert (server.service_backend, server.transport_kind) == ("ray", "distributed")
        first, second = server.clients(2)
        expected = policy()
        for i, client in enumerate([first, second, first]):
            td = TensorDict({"observation": torch.full((4,), float(i))})
            out = client(td, timeout=30.0)
            torch.testing.assert_close(out["action"], expected(td.clone())["action"])
    finally:
        server.shutdown()
    with pytest.raises((MailboxPeerClosedError, MailboxTransportError)):
        first(TensorDict({"observation": torch.zeros(4)}), timeout=5.0)


def _has_torchrl() -> bool:
    try:
        import torchrl  # noqa: F401
    except ImportError:
        return False
    return True


def test_torchrls_scoped_backends_choose_what_arguments_leave_open() -> None:
    pytest.importorskip("torchrl")
    from torchrl import service_backend, transport_backend

    with service_backend("thread"), transport_backend("direct"):
        server = InferenceServer(policy(), num_clients=2)
    with server:
        assert (server.service_backend, server.transport_kind) == ("thread", "direct")
        client = server.client()
        assert client(request())["action"].shape == (2,)
    with transport_backend("distributed"):
        auto = InferenceServer(policy(), transport="auto")  # an explicit argument wins
        assert auto.transport_kind == "thread"
        auto.shutdown()
        with pytest.raises(ValueError, match=r"enclosing torchrl\.transport_backend context"):
            InferenceServer(policy())
    with service_backend("distributed"), pytest.raises(ValueError, match=r"enclosing torchrl\.service_backend"):
        InferenceServer(policy())
    with pytest.raises(ValueError, match="requires num_clients"):
        InferenceServer(policy(), transport="direct")
    with pytest.raises(ValueError, match="explicit transport instance"):
        InferenceServer(policy(), ThreadingTransport(), transport_options={"num_slots": 2})
    with pytest.raises(ValueError, match="transport_options are for service_backend='thread'"):
        InferenceServer(policy_factory=policy, service_backend="process", transport_options={"num_slots": 2})


def test_every_name_of_torchrls_inference_server_module_imports_from_here() -> None:
    torchrl_inference = pytest.importorskip("torchrl.modules.inference_server")
    import ferrobatch.torchrl as ours

    for name in torchrl_inference.__all__:
        assert hasattr(ours, name), name
    # Configs and base classes are TorchRL's own; the server and the transports it owns are ferrobatch's.
    assert ours.InferenceServerConfig is torchrl_inference.InferenceServerConfig
    assert ours.InferenceServer is not torchrl_inference.InferenceServer
    with pytest.raises(AttributeError):
        _ = ours.NotAName


@pytest.mark.ray
@pytest.mark.timeout(180)
def test_the_ray_service_backend_serves_from_a_ray_actor_and_batches_its_clients(ray_cluster: Any) -> None:
    ray = ray_cluster
    server = InferenceServer(
        policy_factory=policy,
        service_backend="ray",
        service_backend_options={"remote_config": {"num_cpus": 0}},
        max_batch_size=8,
        min_batch_size=4,
        timeout=0.05,
    )
    try:
        assert (server.service_backend, server.transport_kind) == ("ray", "ray")
        first, second = server.clients(2)
        assert first is not second and not hasattr(first, "shutdown")
        futures = [c.submit(request(float(i))) for i, c in enumerate([first, second] * 4)]
        results = [f.result(timeout=60) for f in futures]
        expected = policy()
        for i, result in enumerate(results):
            torch.testing.assert_close(result["action"], expected(request(float(i)))["action"])
        stats = server.stats()
        assert stats["requests"] == 8 and stats["batches"] < 8  # the actor batched them
        with pytest.raises(RuntimeError, match="Ray actor"):
            server.update_model(lambda m: None)
    finally:
        server.shutdown()
    assert not server.is_alive and ray.is_initialized()  # Ray is not the server's to stop


@pytest.mark.parametrize(
    "request_td",
    [
        TensorDict({"observation": torch.arange(4.0), "extra": {"deep": torch.ones(1)}}, batch_size=[]),
        TensorDict({"observation": torch.arange(12.0).view(3, 4)}, batch_size=[3]),
        TensorDict({"observation": torch.arange(4.0)}, batch_size=[], device="cpu"),
    ],
    ids=["nested", "batched", "on-a-device"],
)
@pytest.mark.parametrize("nested_output", [False, True])
def test_a_result_is_the_request_with_its_outputs_whatever_path_builds_it(
    request_td: TensorDict, nested_output: bool
) -> None:
    """A result is built from the request's entries at once where it can
    be (a plain TensorDict, top-level keys, no device): the same as the
    request's copy with each output set."""
    from ferrobatch.torchrl import _complete

    rows = request_td.batch_size
    key: Any = ("out", "action") if nested_output else "action"
    pairs = [(key, torch.full((*rows, 2), 7.0)), ("policy_version", torch.full(tuple(rows), 3))]
    expected = request_td.copy()
    for k, v in pairs:
        expected.set(k, v)
    result = _complete(request_td, pairs)
    assert type(result) is type(expected) and result.batch_size == expected.batch_size
    assert result.device == expected.device
    assert set(result.keys(include_nested=True, leaves_only=True)) == set(
        expected.keys(include_nested=True, leaves_only=True)
    )
    assert (result == expected).all()
    assert "action" not in request_td.keys(include_nested=True) and "out" not in request_td.keys()  # a new one


def test_the_transports_are_torchrls_and_a_torchrl_server_serves_them() -> None:
    """ThreadingTransport and SlotTransport are TorchRL InferenceTransports
    (once TorchRL is loaded), with its server-side methods: TorchRL's own
    InferenceServer serves ferrobatch's ThreadingTransport."""
    pytest.importorskip("torchrl")
    from torchrl.modules.inference_server import InferenceServer as TorchRLServer
    from torchrl.modules.inference_server import InferenceTransport

    from ferrobatch.torchrl import SlotTransport

    transport = ThreadingTransport()
    assert isinstance(transport, InferenceTransport)
    assert isinstance(SlotTransport(1), InferenceTransport)
    with TorchRLServer(policy(), transport, max_batch_size=4):
        client = transport.client()
        futures = [transport.submit(request(float(i))) for i in range(3)]
        got = client(request(5.0))
        assert got["action"].shape == (2,)
        expected = policy()(TensorDict({"observation": torch.full((4,), 5.0)}))["action"]
        assert torch.allclose(got["action"], expected)
        assert [f.result(timeout=10)["action"].shape for f in futures] == [(2,)] * 3


def test_a_slot_transport_serves_its_clients_threads_on_the_thread_path() -> None:
    """TorchRL's SlotTransport, switched by its import: at most num_slots
    clients, requests through clients only, a model's exception raised as
    itself, and the requests queued straight from the clients' threads."""
    from ferrobatch.torchrl import SlotTransport

    transport = SlotTransport(num_slots=2)
    with pytest.raises(NotImplementedError):
        transport.submit(request())
    with pytest.raises(ValueError, match="num_slots"):
        SlotTransport(0)

    def model(td: TensorDict) -> TensorDict:
        if (td["observation"] < 0).any():
            raise ValueError("slot model error")
        return td.set("action", td["observation"][..., :2] * 2)

    with InferenceServer(model, transport, max_batch_size=4) as server:
        assert server.transport_kind == "direct"
        clients = [transport.client(), transport.client()]
        with pytest.raises(RuntimeError, match="slots"):
            transport.client()
        results: dict[int, torch.Tensor] = {}

        def run(k: int) -> None:
            results[k] = clients[k](request(float(k + 1)))["action"]

        threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert {k: v.tolist() for k, v in results.items()} == {0: [2.0, 2.0], 1: [4.0, 4.0]}
        with pytest.raises(ValueError, match="slot model error"):
            clients[0](request(-1.0))


def test_torchrls_server_serves_an_mp_transport_through_its_pipes() -> None:
    """MPTransport is a TorchRL InferenceTransport too: TorchRL's own
    server drains its clients' pipes and answers them, a model's exception
    raised as itself."""
    pytest.importorskip("torchrl")
    from torchrl.modules.inference_server import InferenceServer as TorchRLServer
    from torchrl.modules.inference_server import InferenceTransport

    def model(td: TensorDict) -> TensorDict:
        if (td["observation"] < 0).any():
            raise ValueError("negative observation")
        return td.set("action", td["observation"][..., :2] + 1)

    transport = MPTransport()
    assert isinstance(transport, InferenceTransport)
    client = transport.client()
    with TorchRLServer(model, transport, max_batch_size=4):
        futures = [client.submit(request(float(i))) for i in range(4)]
        assert [f.result(timeout=10)["action"].tolist() for f in futures] == [[i + 1.0] * 2 for i in range(4)]
        got = client(request(2.0))
        assert got["action"].tolist() == [3.0, 3.0] and "reward" in got.keys()
        with pytest.raises(ValueError, match="negative observation"):
            client(request(-1.0))


def test_a_client_that_went_away_leaves_torchrls_drain_serving_the_others() -> None:
    pytest.importorskip("torchrl")
    transport = MPTransport()
    gone, staying = transport.client(), transport.client()
    gone._conn.close()  # its process ended: the server's end reads EOF
    staying.submit(request(1.0))
    deadline = time.monotonic() + 10
    tds: list[Any] = []
    while not tds and time.monotonic() < deadline:
        transport.wait_for_work(0.1)
        tds, _ = transport.drain(4)
    assert [td["observation"][0].item() for td in tds] == [1.0]
    assert len(transport._conns) == 1  # the ended pipe was dropped, not read forever


def _shm_specs() -> tuple[TensorDict, TensorDict]:
    request_spec = TensorDict({"observation": torch.zeros(4)})
    response_spec = TensorDict({"action": torch.zeros(2), "policy_version": torch.zeros((), dtype=torch.long)})
    return request_spec, response_spec


def test_a_shared_memory_transport_rides_shared_memory_from_the_start_with_torchrls_rules() -> None:
    from ferrobatch.torchrl import SharedMemoryTransport

    request_spec, response_spec = _shm_specs()
    with pytest.raises(TypeError, match="tensor leaves"):
        SharedMemoryTransport(TensorDict({"text": "hello"}), response_spec, num_slots=1)
    with pytest.raises(ValueError, match="at least one tensor leaf"):
        SharedMemoryTransport(TensorDict({}), response_spec, num_slots=1)
    with pytest.raises(ValueError, match="num_slots"):
        SharedMemoryTransport(request_spec, response_spec, num_slots=0)

    def model(td: TensorDict) -> TensorDict:
        if (td["observation"] < 0).any():
            raise ValueError("negative observation")
        return td.set("action", td["observation"][..., :2] * 2)

    transport = SharedMemoryTransport(request_spec, response_spec, num_slots=1)
    client = transport.client()
    with pytest.raises(KeyError):
        client.submit(TensorDict({"wrong": torch.zeros(4)}))
    with InferenceServer(model, transport, max_batch_size=4) as server:
        assert server.transport_kind == "shared_memory"
        got = client(TensorDict({"observation": torch.ones(4), "extra": torch.zeros(3)}))
        assert set(got.keys()) == {"action", "policy_version"}  # the response spec's keys only
        assert got["action"].tolist() == [2.0, 2.0]
        assert client._route is not None, "the first request did not ride shared memory"
        with pytest.raises(ValueError, match="negative observation"):
            client(TensorDict({"observation": -torch.ones(4)}))
        # One slot: the failed request gave it back, and futures take turns for it.
        futures = [client.submit(TensorDict({"observation": torch.full((4,), float(i))})) for i in range(3)]
        assert [f.result(timeout=10)["action"][0].item() for f in futures] == [0.0, 2.0, 4.0]


def test_a_shared_memory_transport_without_a_server_holds_its_slots_and_times_out_as_torchrl() -> None:
    """No ferrobatch server: requests wait in the clients' pipes for any
    server's drain; a slot is held until the answer comes, and a timed-out
    result() raises queue.Empty (and TimeoutError), the request still in flight."""
    import queue

    from ferrobatch.torchrl import SharedMemoryTransport

    transport = SharedMemoryTransport(*_shm_specs(), num_slots=1)
    client = transport.client()
    first = client.submit(TensorDict({"observation": torch.ones(4)}))
    with pytest.raises(queue.Empty):
        first.result(timeout=0.1)
    with pytest.raises(TimeoutError):
        first.result(timeout=0.05)
    second: list[Future[Any]] = []
    blocked = threading.Thread(target=lambda: second.append(client.submit(TensorDict({"observation": torch.zeros(4)}))))
    blocked.start()
    blocked.join(0.3)
    assert blocked.is_alive(), "a second request took the only slot"
    transport.wait_for_work(5.0)
    tds, callbacks = transport.drain(4)
    assert len(tds) == 1
    transport.resolve(callbacks[0], TensorDict({"action": torch.ones(2), "policy_version": torch.tensor(0)}))
    assert first.result(timeout=10)["action"].tolist() == [1.0, 1.0]
    blocked.join(10)
    assert not blocked.is_alive() and len(second) == 1
    transport.wait_for_work(5.0)
    tds, callbacks = transport.drain(4)
    transport.resolve_exception(callbacks[0], KeyError("boom"))
    with pytest.raises(KeyError, match="boom"):
        second[0].result(timeout=10)


def test_copy_result_false_lends_answers_into_the_response_slots_as_torchrl() -> None:
    """TorchRL's ``copy_result=False``: a result is a view of its request's
    response slot (``transport._response_slots``), and a later result read
    from that slot overwrites it; ``copy_result=True`` results are their own.
    An answer that does not fit its slot fails its request."""
    from ferrobatch.torchrl import SharedMemoryTransport

    def answer_next(transport: Any, action: torch.Tensor) -> None:
        transport.wait_for_work(5.0)
        _, callbacks = transport.drain(1)
        transport.resolve(callbacks[0], TensorDict({"action": action, "policy_version": torch.tensor(3)}))

    borrowed = SharedMemoryTransport(*_shm_specs(), num_slots=1, copy_result=False)
    client = borrowed.client()
    first = client.submit(TensorDict({"observation": torch.ones(4)}))
    answer_next(borrowed, torch.tensor([1.0, 2.0]))
    got = first.result(timeout=10)
    assert got["action"].data_ptr() == borrowed._response_slots["action"][0].data_ptr()
    assert got["action"].tolist() == [1.0, 2.0] and int(got["policy_version"]) == 3
    assert first.result(timeout=10) is got  # read again: the same view
    second = client.submit(TensorDict({"observation": torch.ones(4)}))
    answer_next(borrowed, torch.tensor([5.0, 6.0]))
    assert second.result(timeout=10)["action"].tolist() == [5.0, 6.0]
    assert got["action"].tolist() == [5.0, 6.0], "the slot's later result did not overwrite the view"
    misfit = client.submit(TensorDict({"observation": torch.ones(4)}))
    answer_next(borrowed, torch.zeros(3))
    with pytest.raises(ValueError, match="response slot holds"):
        misfit.result(timeout=10)
    assert second.result(timeout=10)["action"].tolist() == [5.0, 6.0], "a failed request wrote its slot"

    owned = SharedMemoryTransport(*_shm_specs(), num_slots=1)
    assert owned._response_slots is None
    client = owned.client()
    first = client.submit(TensorDict({"observation": torch.ones(4)}))
    answer_next(owned, torch.tensor([1.0, 2.0]))
    second = client.submit(TensorDict({"observation": torch.ones(4)}))
    answer_next(owned, torch.tensor([5.0, 6.0]))
    assert second.result(timeout=10)["action"].tolist() == [5.0, 6.0]
    assert first.result(timeout=10)["action"].tolist() == [1.0, 2.0]

    # Served by ferrobatch, over shared memory: two slots, each request's own.
    borrowed = SharedMemoryTransport(*_shm_specs(), num_slots=2, copy_result=False)
    client = borrowed.client()
    slot_ptrs = {borrowed._response_slots["action"][slot].data_ptr() for slot in range(2)}
    with InferenceServer(lambda td: td.set("action", td["observation"][..., :2] * 2), borrowed, max_batch_size=4):
        called = client(TensorDict({"observation": torch.full((4,), 2.0)}))
        assert client._route is not None, "the request did not ride shared memory"
        assert called["action"].tolist() == [4.0, 4.0] and called["action"].data_ptr() in slot_ptrs
        futures = [client.submit(TensorDict({"observation": torch.full((4,), float(i))})) for i in range(2)]
        results = [f.result(timeout=10) for f in futures]
    assert [r["action"][0].item() for r in results] == [0.0, 2.0]
    assert {r["action"].data_ptr() for r in results} == slot_ptrs  # one slot each


def _borrowing_actor(client: Any, results: Any) -> None:
    bank = client._rules.response_slots["action"][0]
    actions, lent = [], []
    for i in range(2):
        got = client(TensorDict({"observation": torch.full((4,), float(i))}))
        actions.append(got["action"].tolist())  # read before the next request overwrites it
        lent.append(got["action"].data_ptr() == bank.data_ptr())
    results.put((actions, lent))


def test_copy_result_false_lends_into_the_client_process_s_own_slots() -> None:
    ctx = multiprocessing.get_context("spawn")
    from ferrobatch.torchrl import SharedMemoryTransport

    transport = SharedMemoryTransport(*_shm_specs(), num_slots=1, ctx=ctx, copy_result=False)
    with InferenceServer(lambda td: td.set("action", td["observation"][..., :2] + 1), transport, max_batch_size=4):
        results = ctx.Queue()
        process = ctx.Process(target=_borrowing_actor, args=(transport.client(), results))
        process.start()
        actions, lent = results.get(timeout=45)
        process.join(15)
    assert process.exitcode == 0
    assert actions == [[1.0, 1.0], [2.0, 2.0]]
    assert lent == [True, True]
    assert transport._response_slots["action"][0].tolist() == [0.0, 0.0]  # the parent's slots: untouched


def _ray_task_calls(client: Any, values: list[float]) -> list[torch.Tensor]:
    """In a Ray worker: one request per value, in turn; the actions."""
    return [client(request(v))["action"] for v in values]


def _ray_task_raises(client: Any) -> str:
    """In a Ray worker: what the model's exception raises there. (Run once
    the others are done: TorchRL fails a whole batch, so another task's
    request in the same batch would get the exception too.)"""
    try:
        client(TensorDict({"observation": torch.full((4,), -1.0)}))
    except ValueError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "nothing raised"


class _FailsOnNegative(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = policy().module

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        if bool((observation < 0).any()):
            raise ValueError("a negative observation")
        return self.inner(observation)


@pytest.mark.ray
@pytest.mark.timeout(180)
def test_a_ray_transports_tasks_ride_shared_memory_and_raise_the_models_exception(ray_cluster: Any) -> None:
    """RayTransport: the first request (specs unknown) and the exceptions go
    through its actor; every later request of a task on the server's node
    rides shared memory. After shutdown a client fails, never hangs."""
    ray = ray_cluster
    from ferrobatch.torchrl import RayTransport

    transport = RayTransport()
    client = transport.client()  # made before the server starts, as TorchRL's tests do
    model = _FailsOnNegative()
    server = InferenceServer(TensorDictModule(model, in_keys=["observation"], out_keys=["action"]), transport)
    assert server.transport_kind == "ray"
    with server:
        assert client(request(0.5))["action"].shape == (2,)  # through the actor: it teaches the specs
        assert transport._through_actor == 1
        task = ray.remote(num_cpus=0)(_ray_task_calls)
        outs = ray.get([task.remote(client, [float(i), float(i) + 0.5] * 10) for i in range(2)], timeout=120)
        for i, actions in enumerate(outs):
            expected = policy()
            for action, value in zip(actions, [float(i), float(i) + 0.5] * 10):
                torch.testing.assert_close(action, expected(request(value))["action"])
        raises = ray.remote(num_cpus=0)(_ray_task_raises)
        for raised in ray.get([raises.remote(client) for _ in range(2)], timeout=120):
            assert raised == "ValueError: a negative observation"  # the model's own, over the actor
        assert transport._through_actor == 1  # 40 requests, none through the actor
        assert server.stats()["requests"] == 1 + 2 * 21
    started = time.monotonic()
    with pytest.raises(fb.ServerClosedError):
        client(request())
    assert time.monotonic() - started < 10
    with pytest.raises(TypeError, match="RayTransport"):
        from ferrobatch.torchrl import ProcessInferenceServer

        ProcessInferenceServer(policy, RayTransport())


@pytest.mark.ray
@pytest.mark.timeout(180)
def test_a_ray_transports_client_that_cannot_reach_the_share_is_served_through_its_actor(ray_cluster: Any) -> None:
    """A client on another node than the server's (here: one without the
    share's name) sends every request through the transport's actor, and
    gets the same results and the model's own exceptions."""
    from ferrobatch.torchrl import MPClient, RayTransport, _RayConn

    transport = RayTransport(max_queue_size=4)
    elsewhere = MPClient(_RayConn(transport._mailbox), None)
    model = TensorDictModule(_FailsOnNegative(), in_keys=["observation"], out_keys=["action"])
    with InferenceServer(model, transport, max_batch_size=8):
        futures = [elsewhere.submit(request(float(i))) for i in range(12)]  # past max_queue_size: they wait
        expected = policy()
        for i, future in enumerate(futures):
            torch.testing.assert_close(future.result(timeout=60)["action"], expected(request(float(i)))["action"])
        with pytest.raises(ValueError, match="a negative observation"):
            elsewhere(TensorDict({"observation": torch.full((4,), -1.0)}))
        assert transport._through_actor == 13


@pytest.mark.ray
@pytest.mark.timeout(180)
def test_torchrls_server_serves_a_ray_transport_through_its_actor(ray_cluster: Any) -> None:
    pytest.importorskip("torchrl")
    from torchrl.modules.inference_server import InferenceServer as TorchRLServer
    from torchrl.modules.inference_server import InferenceTransport

    from ferrobatch.torchrl import RayTransport

    transport = RayTransport()
    assert isinstance(transport, InferenceTransport)
    clients = [transport.client() for _ in range(3)]
    with TorchRLServer(policy(), transport, max_batch_size=4):
        futures = [c.submit(request(float(i))) for i, c in enumerate(clients)]
        expected = policy()
        for i, future in enumerate(futures):
            torch.testing.assert_close(future.result(timeout=30)["action"], expected(request(float(i)))["action"])
