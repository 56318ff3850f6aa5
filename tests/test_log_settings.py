"""Triton's logging extension: ``GET``/``POST /v2/logging`` and gRPC
``LogSettings`` read and change the ``ferrobatch`` logger's levels, on the
native and the Python front-ends, with tritonclient; a bad setting is a 400
/ INVALID_ARGUMENT that changes nothing."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

import ferrobatch as fb
from ferrobatch.http import _log_settings
from ferrobatch.serve import Listening, ServeConfig, serve_in_thread

pytestmark = pytest.mark.timeout(60)

LOGGER = logging.getLogger("ferrobatch")
DEFAULT = {
    "log_file": "",
    "log_info": True,
    "log_warning": True,
    "log_error": True,
    "log_verbose_level": 0,
    "log_format": "default",
}


@pytest.fixture(autouse=True)
def logger_restored() -> Iterator[None]:
    level, verbose = LOGGER.level, _log_settings._verbose
    LOGGER.setLevel(logging.INFO)
    yield
    LOGGER.setLevel(level)
    _log_settings._verbose = verbose


@pytest.fixture(params=["native", "python"])
def served(request: pytest.FixtureRequest) -> Iterator[Listening]:
    server = fb.Server(
        lambda d: {"y": d["x"]}, inputs=[fb.TensorSpec("x", "float32", (2,))],
        outputs=[fb.TensorSpec("y", "float32", (2,))], name="m",
    )  # fmt: skip
    config = ServeConfig(http_port=0, grpc_port=0, frontend=request.param, log_level="warning", threads=1)
    with serve_in_thread([server], config) as listening:
        yield listening


def test_http_reads_and_changes_the_levels(served: Listening) -> None:
    client = httpclient.InferenceServerClient(f"127.0.0.1:{served.http_port}")
    try:
        assert client.get_log_settings() == DEFAULT
        assert "logging" in client.get_server_metadata()["extensions"]
        verbose = client.update_log_settings({"log_verbose_level": 2})
        assert verbose == {**DEFAULT, "log_verbose_level": 2}
        assert LOGGER.isEnabledFor(logging.DEBUG)
        quiet = client.update_log_settings({"log_verbose_level": 0, "log_info": False, "log_warning": False})
        assert quiet == {**DEFAULT, "log_info": False, "log_warning": False}
        assert not LOGGER.isEnabledFor(logging.WARNING) and LOGGER.isEnabledFor(logging.ERROR)
        assert logging.getLogger("ferrobatch.http").getEffectiveLevel() == logging.ERROR  # the modules' loggers too
        silent = client.update_log_settings({"log_error": False, "log_file": None})  # None: left as it is
        assert silent["log_error"] is False and not LOGGER.isEnabledFor(logging.CRITICAL)
        assert client.update_log_settings({"log_info": True, "log_warning": True, "log_error": True}) == DEFAULT
    finally:
        client.close()


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"log_file": "/tmp/x.log"}, "log file location can not be updated"),
        ({"log_format": "ISO8601"}, "log_format 'ISO8601' is not supported"),
        ({"log_info": "yes"}, "log_info must be true or false"),
        ({"log_verbose_level": -1}, "from 0 to 4294967295"),
        ({"log_verbose_level": True}, "must be an integer"),
        ({"log_level": 1}, "unknown log setting 'log_level'"),
        ({"log_warning": False}, "log_warning off needs log_info off too"),
        ({"log_verbose_level": 1, "log_info": False}, "log_info off needs log_verbose_level 0 too"),
        ([1], "a JSON object of settings"),
    ],
)
def test_http_refuses_a_bad_setting_and_changes_nothing(served: Listening, change: object, error: str) -> None:
    url = f"http://127.0.0.1:{served.http_port}/v2/logging"
    before = httpx.get(url).json()
    refused = httpx.post(url, json=change)
    assert refused.status_code == 400 and error in refused.json()["error"], refused.text
    assert httpx.get(url).json() == before == DEFAULT
    assert LOGGER.getEffectiveLevel() == logging.INFO


def test_grpc_reads_and_changes_the_levels(served: Listening) -> None:
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{served.grpc_port}")
    try:
        settings = client.get_log_settings(as_json=True)["settings"]
        assert settings["log_verbose_level"] == {"uint32_param": 0}
        assert settings["log_info"] == {"bool_param": True} and settings["log_format"] == {"string_param": "default"}
        changed = client.update_log_settings({"log_verbose_level": 1}, as_json=True)["settings"]
        assert changed["log_verbose_level"] == {"uint32_param": 1} and LOGGER.isEnabledFor(logging.DEBUG)
        with pytest.raises(InferenceServerException, match="log_format 'ISO8601'") as refused:
            client.update_log_settings({"log_format": "ISO8601"})
        assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert LOGGER.isEnabledFor(logging.DEBUG)  # nothing changed
    finally:
        client.close()


def test_the_logging_group_is_restricted_as_pytritons_default() -> None:
    from ferrobatch.triton import Tensor, Triton, TritonConfig, batch
    from ferrobatch.triton.triton import TRITON_ACCESS_HEADER

    @batch
    def identity(x: np.ndarray) -> dict[str, np.ndarray]:
        return {"y": x}

    with Triton(config=TritonConfig(http_port=0, allow_grpc=False, allow_metrics=False)) as triton:
        spec = [Tensor(name="x", dtype=np.float32, shape=(-1,))]
        triton.bind("m", identity, inputs=spec, outputs=[Tensor(name="y", dtype=np.float32, shape=(-1,))])
        triton.run()
        url = f"http://127.0.0.1:{triton.http_port}/v2/logging"
        assert httpx.get(url).status_code == 403
        answer = httpx.get(url, headers={TRITON_ACCESS_HEADER: triton.get_access_token()})
        assert answer.status_code == 200 and answer.json()["log_format"] == "default"


def test_the_modules_debug_lines_follow_the_setting(caplog: pytest.LogCaptureFixture) -> None:
    """The setting reaches the lines ferrobatch's modules log (their loggers
    are the ``ferrobatch`` logger's children), not only the document."""
    _log_settings.update({"log_verbose_level": 1})
    logging.getLogger("ferrobatch.http").debug("a debug line")
    assert "a debug line" in caplog.text
    _log_settings.update({"log_verbose_level": 0})
    logging.getLogger("ferrobatch.http").debug("another debug line")
    assert "another debug line" not in caplog.text


def test_an_update_that_changes_nothing_leaves_the_loggers_level_alone() -> None:
    LOGGER.setLevel(logging.NOTSET)  # as most programs leave it: the root's level counts
    assert (
        _log_settings.update({"log_info": LOGGER.isEnabledFor(logging.INFO), "log_file": None})
        == _log_settings.current()
    )
    assert LOGGER.level == logging.NOTSET
