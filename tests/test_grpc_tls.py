"""gRPC over TLS (Triton's ``--grpc-use-ssl``, ``--grpc-use-ssl-mutual``):
``ServeConfig(grpc_use_ssl=, grpc_server_cert=, grpc_server_key=,
grpc_root_cert=)`` and ``TritonConfig``'s fields of the same names, on both
front-ends, with tritonclient's own TLS options; the files checked at start.
``ferrobatch serve --grpc-use-ssl`` is in tests/test_serve.py."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import trustme
from tritonclient.utils import InferenceServerException

import ferrobatch as fb
from ferrobatch.serve import Listening, ServeConfig, check_config, serve_in_thread
from ferrobatch.triton import Tensor, Triton, TritonConfig
from ferrobatch.triton.decorators import batch

pytestmark = pytest.mark.timeout(60)

FRONTENDS = ["native", "python"]


@dataclass
class Pki:
    """A throwaway CA, the server's certificate for 127.0.0.1, and a client's."""

    ca: Path
    cert: Path
    key: Path
    client_cert: Path
    client_key: Path
    #: A client certificate from another CA.
    stranger_cert: Path
    stranger_key: Path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    where = tmp_path_factory.mktemp("pki")
    ca, other = trustme.CA(), trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("client@example.com")
    stranger = other.issue_cert("stranger@example.com")

    def write(name: str, blob: trustme.Blob) -> Path:
        path = where / name
        blob.write_to_path(str(path))
        return path

    return Pki(
        ca=write("ca.pem", ca.cert_pem),
        cert=write("server.pem", server.cert_chain_pems[0]),
        key=write("server.key", server.private_key_pem),
        client_cert=write("client.pem", client.cert_chain_pems[0]),
        client_key=write("client.key", client.private_key_pem),
        stranger_cert=write("stranger.pem", stranger.cert_chain_pems[0]),
        stranger_key=write("stranger.key", stranger.private_key_pem),
    )


def _doubler() -> fb.Server:
    spec = fb.TensorSpec("x", "float32", (2,))
    return fb.Server(
        lambda d: {"y": d["x"] * 2}, inputs=[spec], outputs=[fb.TensorSpec("y", "float32", (2,))], name="m"
    )


def _tls(pki: Pki, *, mutual: bool = False) -> dict[str, object]:
    return {
        "grpc_use_ssl": True,
        "grpc_use_ssl_mutual": mutual,
        "grpc_server_cert": str(pki.cert),
        "grpc_server_key": str(pki.key),
        "grpc_root_cert": str(pki.ca) if mutual else None,
    }


@pytest.fixture(params=FRONTENDS)
def frontend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def served_tls(pki: Pki, frontend: str) -> Iterator[Listening]:
    config = ServeConfig(http_port=0, grpc_port=0, frontend=frontend, threads=1, **_tls(pki))  # type: ignore[arg-type]
    with serve_in_thread([_doubler()], config) as listening:
        yield listening


def _infer(client: grpcclient.InferenceServerClient) -> np.ndarray:
    x = grpcclient.InferInput("x", [1, 2], "FP32")
    x.set_data_from_numpy(np.array([[1.5, -2.0]], dtype=np.float32))
    out = client.infer("m", [x]).as_numpy("y")
    assert out is not None
    return out


def _secure(
    port: int | None, pki: Pki, cert: Path | None = None, key: Path | None = None
) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(
        f"127.0.0.1:{port}",
        ssl=True,
        root_certificates=str(pki.ca),
        private_key=None if key is None else str(key),
        certificate_chain=None if cert is None else str(cert),
    )


def test_a_tls_client_is_served_and_a_plaintext_one_is_not(served_tls: Listening, pki: Pki) -> None:
    with _secure(served_tls.grpc_port, pki) as client:
        assert client.is_server_ready()
        np.testing.assert_array_equal(_infer(client), [[3.0, -4.0]])
        assert client.get_server_metadata(as_json=True)["name"] == "ferrobatch"
    # A plaintext client never gets past the handshake: UNAVAILABLE, and nothing else is harmed.
    with grpcclient.InferenceServerClient(f"127.0.0.1:{served_tls.grpc_port}") as plain:
        with pytest.raises(InferenceServerException) as refused:
            plain.is_server_live(client_timeout=5)
        assert refused.value.status() in ("StatusCode.UNAVAILABLE", "StatusCode.DEADLINE_EXCEEDED")
    # HTTP stays plaintext, as Triton's; gRPC still serves after the refusal.
    http = httpclient.InferenceServerClient(f"127.0.0.1:{served_tls.http_port}")
    try:
        assert http.is_server_ready()
    finally:
        http.close()
    with _secure(served_tls.grpc_port, pki) as client:
        np.testing.assert_array_equal(_infer(client), [[3.0, -4.0]])


def test_a_client_that_does_not_trust_the_servers_ca_is_refused(served_tls: Listening, pki: Pki) -> None:
    with grpcclient.InferenceServerClient(
        f"127.0.0.1:{served_tls.grpc_port}", ssl=True, root_certificates=str(pki.stranger_cert)
    ) as client:
        with pytest.raises(InferenceServerException) as refused:
            client.is_server_live(client_timeout=5)
        assert refused.value.status() in ("StatusCode.UNAVAILABLE", "StatusCode.DEADLINE_EXCEEDED")


def test_mutual_tls_serves_only_clients_with_a_certificate_the_roots_sign(pki: Pki, frontend: str) -> None:
    config = ServeConfig(http_port=None, grpc_port=0, frontend=frontend, threads=1, **_tls(pki, mutual=True))  # type: ignore[arg-type]
    with serve_in_thread([_doubler()], config) as listening:
        with _secure(listening.grpc_port, pki, pki.client_cert, pki.client_key) as client:
            np.testing.assert_array_equal(_infer(client), [[3.0, -4.0]])
        for cert, key in ((None, None), (pki.stranger_cert, pki.stranger_key)):
            with _secure(listening.grpc_port, pki, cert, key) as client:
                with pytest.raises(InferenceServerException) as refused:
                    _infer(client)
                assert refused.value.status() in ("StatusCode.UNAVAILABLE", "StatusCode.DEADLINE_EXCEEDED")
        with _secure(listening.grpc_port, pki, pki.client_cert, pki.client_key) as client:
            np.testing.assert_array_equal(_infer(client), [[3.0, -4.0]])


def test_a_handshake_that_never_comes_is_closed_after_the_header_timeout(pki: Pki) -> None:
    """A connection that sends nothing holds its slot only until the header
    timeout, TLS or not (native front-end: its own timers)."""
    config = ServeConfig(http_port=None, grpc_port=0, threads=1, header_timeout=0.5, **_tls(pki))  # type: ignore[arg-type]
    with serve_in_thread([_doubler()], config) as listening:
        assert listening.grpc_port is not None
        with socket.create_connection(("127.0.0.1", listening.grpc_port)) as idle:
            idle.settimeout(10)
            started = time.monotonic()
            assert idle.recv(1024) == b""  # closed by the server, without a byte sent
            assert time.monotonic() - started < 5
        with _secure(listening.grpc_port, pki) as client:
            np.testing.assert_array_equal(_infer(client), [[3.0, -4.0]])


def _config(**fields: object) -> ServeConfig:
    return ServeConfig(**fields)  # type: ignore[arg-type]


def test_settings_that_make_no_tls_listener_are_refused(pki: Pki, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="grpc_use_ssl needs grpc_server_cert and grpc_server_key"):
        check_config(_config(grpc_use_ssl=True, grpc_server_cert=str(pki.cert)))
    with pytest.raises(ValueError, match="grpc_use_ssl_mutual needs grpc_root_cert"):
        check_config(_config(**{**_tls(pki), "grpc_use_ssl_mutual": True}))
    # Files given with TLS off would serve plaintext to clients that expect TLS.
    with pytest.raises(ValueError, match="grpc_server_cert, grpc_server_key given without grpc_use_ssl"):
        check_config(_config(grpc_server_cert=str(pki.cert), grpc_server_key=str(pki.key)))
    with pytest.raises(ValueError, match="grpc_use_ssl must be True or False"):
        check_config(_config(**{**_tls(pki), "grpc_use_ssl": "false"}))
    missing = tmp_path / "missing.pem"
    with pytest.raises(ValueError, match=f"grpc_server_key {missing}: No such file"):
        check_config(_config(**{**_tls(pki), "grpc_server_key": str(missing)}))
    # The client's key is not the server certificate's.
    with pytest.raises(ValueError, match=f"grpc_server_cert {pki.cert} and grpc_server_key {pki.client_key}"):
        check_config(_config(**{**_tls(pki), "grpc_server_key": str(pki.client_key)}))
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    with pytest.raises(ValueError, match=f"grpc_root_cert {garbage}"):
        check_config(_config(**{**_tls(pki, mutual=True), "grpc_root_cert": str(garbage)}))
    huge = tmp_path / "huge.pem"
    huge.write_bytes(b"A" * ((1 << 20) + 1))
    with pytest.raises(ValueError, match="more than a PEM file holds"):
        check_config(_config(**{**_tls(pki), "grpc_server_cert": str(huge)}))


def test_the_native_front_end_checks_the_files_itself(pki: Pki, tmp_path: Path) -> None:
    """Its own reading (rustls) refuses what the config check would: a
    NativeFrontend made directly, with a key that is not the certificate's
    or an empty certificate file, raises ValueError naming the file."""
    from ferrobatch._core import NativeFrontend

    def start(**tls: object) -> None:
        NativeFrontend("127.0.0.1", None, lambda *a: None, grpc_port=0, **tls).stop(0.0)  # type: ignore[arg-type]

    start(grpc_server_cert=str(pki.cert), grpc_server_key=str(pki.key))
    with pytest.raises(ValueError, match=f"server certificate {pki.cert} and key {pki.client_key}"):
        start(grpc_server_cert=str(pki.cert), grpc_server_key=str(pki.client_key))
    empty = tmp_path / "empty.pem"
    empty.write_text("")
    with pytest.raises(ValueError, match=f"server certificate {empty}: no certificate in it"):
        start(grpc_server_cert=str(empty), grpc_server_key=str(pki.key))
    with pytest.raises(ValueError, match="needs both grpc_server_cert and grpc_server_key"):
        start(grpc_server_cert=str(pki.cert))
    with pytest.raises(ValueError, match="mutual TLS needs the root certificates"):
        start(grpc_server_cert=str(pki.cert), grpc_server_key=str(pki.key), grpc_use_ssl_mutual=True)


def test_tritonconfig_serves_grpc_over_tls(pki: Pki) -> None:
    @batch
    def double(x: np.ndarray) -> dict[str, np.ndarray]:
        return {"y": x * 2}

    config = TritonConfig(
        http_port=0,
        grpc_port=0,
        allow_metrics=False,
        grpc_use_ssl_mutual=True,
        grpc_server_cert=pki.cert,  # pathlib.Path, as PyTriton's fields are
        grpc_server_key=pki.key,
        grpc_root_cert=pki.ca,
    )
    with Triton(config=config) as triton:
        spec = [Tensor(name="x", dtype=np.float32, shape=(2,))]
        triton.bind("m", double, inputs=spec, outputs=[Tensor(name="y", dtype=np.float32, shape=(2,))])
        triton.run()
        with _secure(triton.grpc_port, pki, pki.client_cert, pki.client_key) as client:
            np.testing.assert_array_equal(_infer(client), [[3.0, -4.0]])
        with _secure(triton.grpc_port, pki) as client, pytest.raises(InferenceServerException):
            _infer(client)


def test_an_embedded_grpc_server_serves_tls_with_credentials(pki: Pki) -> None:
    """``ferrobatch.grpc.grpc_server(..., credentials=)`` binds ``address``
    over TLS, for apps that run their own ``grpc.aio`` server."""
    import asyncio

    import grpc
    import tritonclient.grpc.aio as aiogrpcclient

    from ferrobatch.grpc import grpc_server

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    credentials = grpc.ssl_server_credentials([(pki.key.read_bytes(), pki.cert.read_bytes())])
    model = _doubler()

    async def scenario() -> None:
        async with model:
            server = grpc_server([model], f"127.0.0.1:{port}", credentials=credentials)
            await server.start()
            client = aiogrpcclient.InferenceServerClient(f"127.0.0.1:{port}", ssl=True, root_certificates=str(pki.ca))
            try:
                x = aiogrpcclient.InferInput("x", [1, 2], "FP32")
                x.set_data_from_numpy(np.array([[1.5, -2.0]], dtype=np.float32))
                result = await client.infer("m", [x])
                np.testing.assert_array_equal(result.as_numpy("y"), [[3.0, -4.0]])
            finally:
                await client.close()
                await server.stop(None)

    asyncio.run(scenario())
