"""Triton's ``--id`` and ``--log-file``: the name server metadata answers
(``ServeConfig(server_id=)``, ``TritonConfig(id=)``), on both front-ends and
both protocols, and the log written to a file (``TritonConfig(log_file=)``,
reported by ``GET /v2/logging``). ``ferrobatch serve --id --log-file`` is in
tests/test_serve.py."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

import ferrobatch as fb
from ferrobatch.http.protocol import SERVER_ID, ModelRepository
from ferrobatch.serve import Listening, ServeConfig, check_config, serve_in_thread
from ferrobatch.triton import Tensor, Triton, TritonConfig
from ferrobatch.triton.constants import TRITON_ACCESS_HEADER

pytestmark = pytest.mark.timeout(60)


def _identity() -> fb.Server:
    spec = fb.TensorSpec("x", "float32", (2,))
    return fb.Server(lambda d: {"y": d["x"]}, inputs=[spec], outputs=[fb.TensorSpec("y", "float32", (2,))], name="m")


@pytest.fixture(params=["native", "python"])
def served_as_triton(request: pytest.FixtureRequest) -> Iterator[Listening]:
    config = ServeConfig(http_port=0, grpc_port=0, frontend=request.param, server_id="triton", threads=1)
    with serve_in_thread([_identity()], config) as listening:
        yield listening


def test_server_metadata_answers_the_configured_name(served_as_triton: Listening) -> None:
    http = httpclient.InferenceServerClient(f"127.0.0.1:{served_as_triton.http_port}")
    try:
        assert http.get_server_metadata()["name"] == "triton"
    finally:
        http.close()
    with grpcclient.InferenceServerClient(f"127.0.0.1:{served_as_triton.grpc_port}") as grpc:
        metadata = grpc.get_server_metadata(as_json=True)
        assert metadata["name"] == "triton"
        assert metadata["version"] == fb.__version__


def test_the_default_name_is_ferrobatchs() -> None:
    assert ServeConfig().server_id == SERVER_ID == "ferrobatch"
    assert ModelRepository(_identity()).server_metadata()["name"] == "ferrobatch"


@pytest.mark.parametrize("bad", ["", 7, None])
def test_a_name_that_is_no_string_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="server_id must be a non-empty string"):
        check_config(ServeConfig(server_id=bad))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="server_id must be a non-empty string"):
        ModelRepository(_identity(), server_id=bad)  # type: ignore[arg-type]


def test_tritonconfig_id_names_the_server_and_log_file_takes_the_log(tmp_path: Path) -> None:
    log_file = tmp_path / "triton.log"
    logger = logging.getLogger("ferrobatch")
    before = logger.level, logger.propagate, list(logger.handlers)

    def identity(x: np.ndarray) -> dict[str, np.ndarray]:
        return {"y": x}

    config = TritonConfig(
        http_port=0, allow_grpc=False, allow_metrics=False, id="triton", log_file=log_file
    )  # a Path, as PyTriton's field
    with Triton(config=config) as triton:
        spec = [Tensor(name="x", dtype=np.float32, shape=(-1,))]
        triton.bind("m", identity, inputs=spec, outputs=[Tensor(name="y", dtype=np.float32, shape=(-1,))])
        triton.run()
        base = f"http://127.0.0.1:{triton.http_port}/v2"
        assert httpx.get(base).json()["name"] == "triton"
        token = {TRITON_ACCESS_HEADER: triton.get_access_token()}
        assert httpx.get(f"{base}/logging", headers=token).json()["log_file"] == str(log_file)
        logging.getLogger("ferrobatch.test").warning("a line of this run")
    written = log_file.read_text()
    assert "models ['m']: HTTP port" in written, written  # the run's own start-up line
    assert "WARNING ferrobatch.test: a line of this run" in written
    # The logger is as it was once the run has ended; later lines do not reach the file.
    assert (logger.level, logger.propagate, list(logger.handlers)) == before
    logging.getLogger("ferrobatch.test").warning("after the run")
    assert "after the run" not in log_file.read_text()


def test_tritonconfig_without_id_is_ferrobatch() -> None:
    from ferrobatch.triton.triton import serve_config

    assert serve_config(TritonConfig(), expose_errors=False, frontend="native").server_id == "ferrobatch"
    assert serve_config(TritonConfig(id="triton"), expose_errors=False, frontend="native").server_id == "triton"
