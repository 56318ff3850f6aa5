"""The native HTTP front-end (``ServeConfig(frontend="native")``, the
default of ``ferrobatch serve``): inference answered in Rust for every model
(fixed, BYTES and variable-length tensors), the rest of the v2 surface by
the Python handlers, every request answered and counted once."""

from __future__ import annotations

import gzip
import json
import socket
import threading
import time
import urllib.error
import urllib.request
import zlib
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch
import tritonclient.http as httpclient

import ferrobatch as fb
from ferrobatch.serve import Listening, ServeConfig, StartupError, serve_in_thread

X = fb.TensorSpec("x", "float32", (4,))
Y = fb.TensorSpec("y", "float32", (4,))
N = fb.TensorSpec("n", "int64", ())


def double(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    x = inputs["x"]
    return {"y": x * 2, "n": (x > 0).sum(dim=1)}


def native(**overrides: object) -> ServeConfig:
    return ServeConfig(http_port=0, grpc_port=None, frontend="native", **overrides)  # type: ignore[arg-type]


@pytest.fixture
def served() -> Iterator[tuple[fb.Server, str]]:
    server = fb.Server(double, inputs=[X], outputs=[Y, N], name="m", max_batch_size=16, max_delay=0.002)
    with serve_in_thread([server], native()) as listening:
        yield server, f"http://127.0.0.1:{listening.http_port}"


def infer_body(x: list[list[float]], **extra: object) -> bytes:
    shape = [len(x), len(x[0])]
    return json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": shape, "data": x}], **extra}).encode()


def outcomes(server: fb.Server) -> Counter[str]:
    stats = server.stats()
    return Counter({"succeeded": stats["requests_succeeded"], **stats["requests_failed"]})


def test_json_infer_is_answered_with_each_callers_rows(served: tuple[fb.Server, str]) -> None:
    server, base = served
    body = infer_body([[1, -2, 3, 0.5], [0, 0, 0, 1]], id="r-7")
    response = httpx.post(f"{base}/v2/models/m/infer", content=body)
    assert response.status_code == 200, response.text
    doc = response.json()
    assert doc["id"] == "r-7" and doc["model_name"] == "m"
    by_name = {o["name"]: o for o in doc["outputs"]}
    assert by_name["y"] == {"name": "y", "datatype": "FP32", "shape": [2, 4], "data": [2, -4, 6, 1, 0, 0, 0, 2]}
    assert by_name["n"]["data"] == [3, 1] and by_name["n"]["shape"] == [2]
    # One output asked for, as binary.
    body = infer_body([[1, 2, 3, 4]], outputs=[{"name": "n", "parameters": {"binary_data": True}}])
    response = httpx.post(f"{base}/v2/models/m/infer", content=body)
    length = int(response.headers["inference-header-content-length"])
    header = json.loads(response.content[:length])
    assert [o["name"] for o in header["outputs"]] == ["n"]
    assert np.frombuffer(response.content[length:], np.int64).tolist() == [4]
    assert outcomes(server)["succeeded"] == 2


def test_tritonclient_binary_infer_many_callers_at_once(served: tuple[fb.Server, str]) -> None:
    server, base = served
    client = httpclient.InferenceServerClient(base.removeprefix("http://"), concurrency=16)
    assert client.is_server_ready() and client.is_model_ready("m")
    handles = []
    for i in range(64):
        tensor = httpclient.InferInput("x", [1, 4], "FP32")
        tensor.set_data_from_numpy(np.full((1, 4), i, np.float32), binary_data=True)
        wanted = [httpclient.InferRequestedOutput("y", binary_data=True)]
        handles.append(client.async_infer("m", [tensor], outputs=wanted))
    for i, handle in enumerate(handles):
        np.testing.assert_array_equal(handle.get_result().as_numpy("y"), np.full((1, 4), 2 * i, np.float32))
    client.close()
    assert outcomes(server)["succeeded"] == 64


def binary_body(x: np.ndarray, shape: list[int] | None = None) -> tuple[bytes, dict[str, str]]:
    """A binary-extension request of ``x`` (as FP32) asking for ``y`` as binary."""
    raw = x.astype(np.float32).tobytes()
    tensor = {"name": "x", "datatype": "FP32", "shape": shape or list(x.shape)}
    doc = {
        "inputs": [{**tensor, "parameters": {"binary_data_size": len(raw)}}],
        "outputs": [{"name": "y", "parameters": {"binary_data": True}}],
    }
    header = json.dumps(doc).encode()
    return header + raw, {
        "Inference-Header-Content-Length": str(len(header)),
        "Content-Type": "application/octet-stream",
    }


def test_repeated_binary_headers_answer_each_requests_own_rows(served: tuple[fb.Server, str]) -> None:
    """A model remembers the binary headers it decoded (``v2::HeaderMemo``, per
    runtime thread): the same header with other bytes, more shapes than it
    holds, and a refused header, each time counted again."""
    server, base = served
    url = f"{base}/v2/models/m/infer"
    with httpx.Client() as client:  # one connection: one runtime thread's memo
        for turn in range(3):
            for rows in range(1, 8):
                x = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4) + turn
                body, headers = binary_body(x)
                response = client.post(url, content=body, headers=headers)
                assert response.status_code == 200, response.text
                length = int(response.headers["inference-header-content-length"])
                y = np.frombuffer(response.content[length:], np.float32).reshape(rows, 4)
                np.testing.assert_array_equal(y, x * 2)
            body, headers = binary_body(np.zeros((1, 3)))
            response = client.post(url, content=body, headers=headers)
            assert response.status_code == 400 and "expected shape (n, 4)" in response.json()["error"]
    seen = outcomes(server)
    assert seen["succeeded"] == 21 and seen["invalid_input"] == 3


def test_a_remembered_header_with_its_data_inline_answers_each_time(served: tuple[fb.Server, str]) -> None:
    """A binary-extension request whose header carries its input's data
    (JSON) and no bytes after it: remembered after the first, each later one
    is answered from the memo's own copy of the data (lent, not taken)."""
    server, base = served
    header = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]})
    headers = {"Inference-Header-Content-Length": str(len(header)), "Content-Type": "application/octet-stream"}
    with httpx.Client() as client:  # one connection: one runtime thread's memo
        for _ in range(3):
            response = client.post(f"{base}/v2/models/m/infer", content=header.encode(), headers=headers)
            assert response.status_code == 200, response.text
            assert response.json()["outputs"][0]["data"] == [2, 4, 6, 8]
    assert outcomes(server)["succeeded"] == 3


def test_http2_cleartext_with_prior_knowledge(served: tuple[fb.Server, str]) -> None:
    _, base = served
    with httpx.Client(http1=False, http2=True) as client:
        response = client.post(f"{base}/v2/models/m/infer", content=infer_body([[1, 1, 1, 1]]))
    assert response.http_version == "HTTP/2"
    assert response.json()["outputs"][0]["data"] == [2, 2, 2, 2]


def test_bad_requests_get_a_4xx_naming_the_problem_and_harm_nothing(served: tuple[fb.Server, str]) -> None:
    server, base = served
    url = f"{base}/v2/models/m/infer"
    wrong_shape = b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1,3],"data":[1,2,3]}]}'
    cases = {
        wrong_shape: (400, "input 'x': expected shape (n, 4), got (1, 3)"),
        b'{"inputs":[{"name":"x","datatype":"INT32","shape":[1,4],"data":[1,2,3,4]}]}': (
            400,
            "input 'x': expected dtype float32, got int32",
        ),
        b'{"inputs":[{"name":"x"': (400, "malformed JSON"),
        b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1,1000000000000],"data":[]}]}': (400, "elements"),
        b'{"inputs":[{"name":"q","datatype":"FP32","shape":[1,4],"data":[1,2,3,4]}]}': (400, "unexpected input 'q'"),
        infer_body([[1, 2, 3, 4]] * 17): (400, "exceeds max_batch_size (16)"),
        # Each entry is sent in full: repeats would multiply the reply.
        infer_body([[1, 2, 3, 4]], outputs=[{"name": "y"}, {"name": "y"}]): (400, "output 'y' is asked for twice"),
    }
    for body, (status, text) in cases.items():
        response = httpx.post(url, content=body)
        assert response.status_code == status, (body, response.text)
        assert text in response.json()["error"], (body, response.text)
    unknown = httpx.post(f"{base}/v2/models/nope/infer", content=wrong_shape)
    assert unknown.status_code == 400 and "unknown model" in unknown.json()["error"]
    assert httpx.get(f"{base}/v2/nothing/here").status_code == 404
    assert httpx.get(f"{base}/v2/models/nope/ready").status_code == 400
    # Still serving, and only the requests that reached the model's inputs counted.
    assert httpx.post(url, content=infer_body([[1, 2, 3, 4]])).status_code == 200
    seen = outcomes(server)
    assert seen["succeeded"] == 1 and seen["invalid_input"] == 4


def test_an_inference_header_length_that_is_not_text_is_refused(served: tuple[fb.Server, str]) -> None:
    """Not taken for no header (the body read as JSON): refused as the bad
    length it is."""
    server, base = served
    header = json.dumps(
        {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "parameters": {"binary_data_size": 16}}]}
    ).encode()
    body = header + np.ones(4, np.float32).tobytes()
    for length in (b"\xff" + str(len(header)).encode(), b"abc"):
        response = httpx.post(
            f"{base}/v2/models/m/infer", content=body, headers={"Inference-Header-Content-Length": length}
        )
        assert response.status_code == 400, (length, response.text)
        assert "Inference-Header-Content-Length must be" in response.json()["error"], response.text
    good = httpx.post(
        f"{base}/v2/models/m/infer", content=body, headers={"Inference-Header-Content-Length": str(len(header))}
    )
    assert good.status_code == 200, good.text
    assert outcomes(server) == Counter({"succeeded": 1})


def test_an_inference_header_length_given_twice_is_refused(served: tuple[fb.Server, str]) -> None:
    """Which of two lengths the client meant is a guess: 400, as on the
    Python front-end's apps."""
    _, base = served
    header = json.dumps(
        {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "parameters": {"binary_data_size": 16}}]}
    ).encode()
    body = header + np.ones(4, np.float32).tobytes()
    for lengths in ([len(header)] * 2, [len(header), len(header) + 1]):
        twice = [("Inference-Header-Content-Length", str(n)) for n in lengths]
        response = httpx.post(f"{base}/v2/models/m/infer", content=body, headers=twice)
        assert response.status_code == 400, response.text
        assert "Inference-Header-Content-Length is given more than once" in response.json()["error"]


def test_a_body_over_the_limit_is_refused_before_it_is_read() -> None:
    server = fb.Server(double, inputs=[X], outputs=[Y, N], name="m")
    with serve_in_thread([server], native(max_body_size=1024)) as listening:
        url = f"http://127.0.0.1:{listening.http_port}/v2/models/m/infer"
        response = httpx.post(url, content=b" " * 4096)
        assert response.status_code == 413
        assert "over the limit of 1024 bytes" in response.json()["error"]
        assert response.headers["connection"] == "close"


def test_the_rest_of_the_v2_surface_and_other_codings_go_to_the_python_handlers(
    served: tuple[fb.Server, str],
) -> None:
    _, base = served
    assert httpx.get(f"{base}/v2").json()["name"] == "ferrobatch"
    meta = httpx.get(f"{base}/v2/models/m").json()
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]
    assert httpx.get(f"{base}/v2/models/m/versions/1/config").json()["max_batch_size"] == 16
    assert "nv_inference_request_success" in httpx.get(f"{base}/metrics").text
    body = infer_body([[1, 2, 3, 4]])
    response = httpx.post(f"{base}/v2/models/m/infer", content=body, headers={"content-encoding": "br"})
    assert response.status_code == 400
    assert "unsupported Content-Encoding" in response.json()["error"]


def post_raw(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    """A POST whose response body is returned as sent (urllib does not undo codings)."""
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, {k.lower(): v for k, v in response.headers.items()}, response.read()
    except urllib.error.HTTPError as error:
        return error.code, {k.lower(): v for k, v in error.headers.items()}, error.read()


CODERS = {"gzip": gzip.compress, "deflate": zlib.compress}
DECODERS = {"gzip": gzip.decompress, "deflate": zlib.decompress}


@pytest.mark.parametrize("request_coding", ["gzip", "deflate"])
@pytest.mark.parametrize(
    ("accept", "response_coding"),
    [("gzip", "gzip"), ("deflate", "deflate"), ("deflate, gzip;q=0.5", "gzip"), ("gzip;q=0, deflate", "deflate")],
)
def test_coded_bodies_are_inflated_natively_and_responses_coded_as_accepted(
    served: tuple[fb.Server, str], request_coding: str, accept: str, response_coding: str
) -> None:
    server, base = served
    x = [[1.0, 2.0, 3.0, 4.0]] * 3
    # Binary output: the inference header's length counts the uncoded JSON, as Triton sends it.
    plain = infer_body(x, outputs=[{"name": "y", "parameters": {"binary_data": True}}])
    headers = {"content-encoding": request_coding, "accept-encoding": accept}
    status, got, raw = post_raw(f"{base}/v2/models/m/infer", CODERS[request_coding](plain), headers)
    assert status == 200, raw
    assert got["content-encoding"] == response_coding
    body = DECODERS[response_coding](raw)
    length = int(got["inference-header-content-length"])
    assert json.loads(body[:length])["outputs"][0]["shape"] == [3, 4]
    assert np.frombuffer(body[length:], np.float32).tolist() == [2.0, 4.0, 6.0, 8.0] * 3
    # No Accept-Encoding: sent as is.
    status, got, raw = post_raw(
        f"{base}/v2/models/m/infer", CODERS[request_coding](infer_body(x)), {"content-encoding": request_coding}
    )
    assert status == 200 and "content-encoding" not in got
    assert json.loads(raw)["outputs"][0]["data"] == [2.0, 4.0, 6.0, 8.0] * 3
    assert outcomes(server)["succeeded"] == 2


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_tritonclient_request_and_response_compression(served: tuple[fb.Server, str], algorithm: str) -> None:
    _, base = served
    client = httpclient.InferenceServerClient(base.removeprefix("http://"))
    x = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
    for binary in (True, False):
        tensor = httpclient.InferInput("x", [8, 4], "FP32")
        tensor.set_data_from_numpy(x, binary_data=binary)
        outputs = [httpclient.InferRequestedOutput("y", binary_data=binary)]
        result = client.infer(
            "m",
            [tensor],
            outputs=outputs,
            request_compression_algorithm=algorithm,
            response_compression_algorithm=algorithm,
        )
        np.testing.assert_array_equal(result.as_numpy("y"), x * 2)
        assert result.get_response()["model_name"] == "m"
    client.close()


def test_a_coded_body_is_inflated_within_max_decompressed_size() -> None:
    server = fb.Server(double, inputs=[X], outputs=[Y, N], name="m")
    limit = 1 << 20
    with serve_in_thread([server], native(max_decompressed_size=limit)) as listening:
        url = f"http://127.0.0.1:{listening.http_port}/v2/models/m/infer"
        # A bomb: 64 MiB of spaces in some 64 KiB; refused once past the limit, not inflated.
        bomb = zlib.compress(b" " * (64 << 20), 9)
        assert len(bomb) < 100_000
        status, _, raw = post_raw(url, bomb, {"content-encoding": "deflate"})
        assert status == 413, raw
        assert f"deflate request body expands past the limit of {limit} bytes" in json.loads(raw)["error"]
        status, _, raw = post_raw(url, gzip.compress(b" " * (limit + 1)), {"content-encoding": "gzip"})
        assert status == 413, raw
        # Exactly the limit: inflated (then refused by the codec: spaces are not a request).
        status, _, raw = post_raw(url, gzip.compress(b" " * limit), {"content-encoding": "gzip"})
        assert status == 400, raw
        good = infer_body([[1, 2, 3, 4]])
        for coding, coded in (("gzip", gzip.compress(good)), ("deflate", zlib.compress(good))):
            for broken in (coded[:-4], b"not " + coded, coded + b"trailing"):
                status, _, raw = post_raw(url, broken, {"content-encoding": coding})
                assert status == 400, (coding, broken, raw)
                assert f"request body is not valid {coding}" in json.loads(raw)["error"]
        # The server goes on serving.
        status, _, raw = post_raw(url, gzip.compress(good), {"content-encoding": "gzip"})
        assert status == 200 and json.loads(raw)["outputs"][0]["data"] == [2, 4, 6, 8]
    assert outcomes(server)["succeeded"] == 1


def poisoned(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    x = inputs["x"]
    if bool((x < 0).any()):
        raise ValueError("secret path /srv/model: negative input")
    return {"y": x * 2, "n": (x > 0).sum(dim=1)}


def test_a_failing_request_fails_alone_and_the_client_does_not_see_the_models_text() -> None:
    # All twelve in one batch (min_batch_size): the retries that isolate the
    # bad one stay within the batch's budget (one extra call per request).
    server = fb.Server(poisoned, inputs=[X], outputs=[Y, N], name="p", max_batch_size=32, min_batch_size=12)
    with serve_in_thread([server], native()) as listening:
        url = f"http://127.0.0.1:{listening.http_port}/v2/models/p/infer"
        bodies = [infer_body([[-1.0 if i == 5 else float(i)] * 4]) for i in range(12)]
        with ThreadPoolExecutor(12) as pool:
            responses = list(pool.map(lambda b: httpx.post(url, content=b), bodies))
    statuses = [r.status_code for r in responses]
    assert statuses == [500 if i == 5 else 200 for i in range(12)], statuses
    error = responses[5].json()["error"]
    assert "model 'p' failed: ValueError (request id" in error and "secret" not in error
    seen = outcomes(server)
    assert seen["succeeded"] == 11 and seen["model_error"] == 1


def gated_model(gate: threading.Event, entered: threading.Event):  # type: ignore[no-untyped-def]
    """A model that says when a batch is in it and holds it until ``gate``."""

    def model(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        entered.set()
        gate.wait(30)
        return double(inputs)

    return model


def test_a_passed_deadline_is_a_504_counted_once() -> None:
    gate, entered = threading.Event(), threading.Event()
    server = fb.Server(gated_model(gate, entered), inputs=[X], outputs=[Y, N], name="s", max_batch_size=1, max_delay=0)
    with serve_in_thread([server], native()) as listening:
        url = f"http://127.0.0.1:{listening.http_port}/v2/models/s/infer"
        first = threading.Thread(target=httpx.post, args=(url,), kwargs={"content": infer_body([[1, 2, 3, 4]])})
        first.start()
        # The first holds the model (a sleep could lose the race to a slow
        # client thread); this one waits in the queue.
        assert entered.wait(10)
        body = infer_body([[1, 2, 3, 4]], parameters={"timeout": 50_000})
        response = httpx.post(url, content=body)
        gate.set()
        first.join()
        assert response.status_code == 504
        assert "exceeded its 0.05s timeout" in response.json()["error"]
        time.sleep(0.4)
    seen = outcomes(server)
    assert seen["deadline_exceeded"] == 1 and seen["succeeded"] == 1
    assert server.stats()["batches"] == 1  # the expired request never ran


def test_a_client_that_goes_away_withdraws_its_queued_request() -> None:
    gate, entered = threading.Event(), threading.Event()
    server = fb.Server(gated_model(gate, entered), inputs=[X], outputs=[Y, N], name="g", max_batch_size=1, max_delay=0)
    with serve_in_thread([server], native()) as listening:
        port = listening.http_port
        assert port is not None
        url = f"http://127.0.0.1:{port}/v2/models/g/infer"
        holder = threading.Thread(target=httpx.post, args=(url,), kwargs={"content": infer_body([[1, 2, 3, 4]])})
        holder.start()
        assert entered.wait(10)  # the holder's batch is in the model
        body = infer_body([[5, 5, 5, 5]])
        with socket.create_connection(("127.0.0.1", port)) as sock:
            head = f"POST /v2/models/g/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
            sock.sendall(head.encode() + body)
            time.sleep(0.2)  # queued behind the held batch
        deadline = time.monotonic() + 5
        while outcomes(server)["cancelled"] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        gate.set()
        holder.join()
        time.sleep(0.1)
    seen = outcomes(server)
    assert seen["cancelled"] == 1 and seen["succeeded"] == 1, seen
    assert server.stats()["batches"] == 1


def test_stats_equal_what_the_callers_saw_under_concurrent_load() -> None:
    server = fb.Server(poisoned, inputs=[X], outputs=[Y, N], name="c", max_batch_size=8, max_delay=0.001)
    with serve_in_thread([server], native()) as listening:
        url = f"http://127.0.0.1:{listening.http_port}/v2/models/c/infer"

        def call(i: int) -> int:
            if i % 10 == 3:
                body = infer_body([[-1, 1, 1, 1]])
            elif i % 10 == 7:
                body = b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1,2],"data":[1,2]}]}'
            else:
                body = infer_body([[float(i)] * 4])
            return httpx.post(url, content=body, timeout=30).status_code

        with ThreadPoolExecutor(16) as pool:
            statuses = Counter(pool.map(call, range(200)))
    seen = outcomes(server)
    # Two bad requests in one batch may exhaust the retry budget and fail a
    # few innocent neighbours: whatever the callers saw, stats() saw the same.
    assert statuses[400] == 20 and statuses[500] >= 20 and sum(statuses.values()) == 200
    assert (seen["succeeded"], seen["model_error"], seen["invalid_input"]) == (statuses[200], statuses[500], 20)
    assert sum(seen.values()) == 200


def test_a_port_in_use_fails_before_warm_up() -> None:
    warmed: list[bool] = []

    def model(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        warmed.append(True)
        return double(inputs)

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = fb.Server(model, inputs=[X], outputs=[Y, N], name="w", warmup=True)
        config = ServeConfig(http_port=port, grpc_port=None, frontend="native")
        with pytest.raises(StartupError, match=f"cannot listen on 127.0.0.1:{port}"):
            with serve_in_thread([server], config):
                pass
    assert warmed == []


def test_both_front_ends_answer_the_same(tmp_path: object) -> None:
    replies: dict[str, list[object]] = {}
    for frontend in ("native", "python"):
        server = fb.Server(double, inputs=[X], outputs=[Y, N], name="m")
        config = ServeConfig(http_port=0, grpc_port=None, frontend=frontend)
        with serve_in_thread([server], config) as listening:
            base = f"http://127.0.0.1:{listening.http_port}"
            replies[frontend] = [
                httpx.post(f"{base}/v2/models/m/infer", content=infer_body([[1.5, -2, 0, 1e-8]], id="q")).json(),
                httpx.post(f"{base}/v2/models/m/infer", content=b'{"inputs":[]}').json(),
                httpx.get(f"{base}/v2/models/m").json(),
                httpx.get(f"{base}/v2/health/ready").status_code,
            ]
    assert replies["native"] == replies["python"]


def test_two_native_front_ends_of_one_running_server_each_answer_and_count_their_own() -> None:
    server = fb.Server(double, inputs=[X], outputs=[Y, N], name="m")
    body = infer_body([[1.0, 2.0, 3.0, 4.0]])

    def infer(listening: Listening) -> int:
        url = f"http://127.0.0.1:{listening.http_port}/v2/models/m/infer"
        with ThreadPoolExecutor(4) as pool:
            responses = list(pool.map(lambda _: httpx.post(url, content=body, timeout=10), range(4)))
        assert all(r.json()["outputs"][0]["data"] == [2, 4, 6, 8] for r in responses)
        return sum(r.status_code == 200 for r in responses)

    with server.run_in_background():
        with serve_in_thread([server], native()) as first:
            answered = infer(first)
            with serve_in_thread([server], native()) as second:
                answered += infer(second) + infer(first)  # the first still answers its own
            answered += infer(first)
        with serve_in_thread([server], native()) as third:
            answered += infer(third)
        seen = outcomes(server)
    assert answered == 20 and seen["succeeded"] == 20 and sum(seen.values()) == 20


def test_listening_reports_the_bound_port() -> None:
    server = fb.Server(double, inputs=[X], outputs=[Y, N], name="m")
    with serve_in_thread([server], native()) as listening:
        assert isinstance(listening, Listening) and listening.http_port not in (None, 0)


T = fb.TensorSpec("t", "bytes", (1,))


class HeldBytes:
    """A BYTES model whose first batch waits for ``release``: the next
    requests queue."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.entered.set()
        self.release.wait(30)
        return {"t": inputs["t"]}


def test_clients_that_go_away_withdraw_their_requests_to_a_bytes_model() -> None:
    held = HeldBytes()
    server = fb.Server(held, inputs=[T], outputs=[T], name="b", max_batch_size=1, max_delay=0)
    gone = 5
    with serve_in_thread([server], native()) as listening:
        port = listening.http_port
        assert port is not None
        url = f"http://127.0.0.1:{port}/v2/models/b/infer"
        body = json.dumps({"inputs": [{"name": "t", "datatype": "BYTES", "shape": [1, 1], "data": ["hi"]}]}).encode()
        holder = threading.Thread(target=httpx.post, args=(url,), kwargs={"content": body, "timeout": 30})
        holder.start()
        assert held.entered.wait(30)
        head = f"POST /v2/models/b/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        socks = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(gone)]
        for sock in socks:
            sock.sendall(head + body)
        deadline = time.monotonic() + 10
        while server.stats()["queue_depth"] < gone and time.monotonic() < deadline:
            time.sleep(0.01)
        for sock in socks:
            sock.close()
        while outcomes(server)["cancelled"] < gone and time.monotonic() < deadline:
            time.sleep(0.01)
        # Nothing waits on a thread for them: the rest of the surface answers at once.
        began = time.monotonic()
        assert httpx.get(f"http://127.0.0.1:{port}/v2/models/b/config", timeout=10).status_code == 200
        assert time.monotonic() - began < 2
        held.release.set()
        holder.join(30)
    seen = outcomes(server)
    assert seen["cancelled"] == gone and seen["succeeded"] == 1, seen
    assert server.stats()["batches"] == 1  # the withdrawn requests never ran


def test_echoed_client_strings_are_clipped(served: tuple[fb.Server, str]) -> None:
    """A huge method, a shape past 2**64, a huge input name: each answer
    echoes what was sent, cut short (never u64::MAX for the shape)."""
    _, base = served
    port = int(base.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"X" * 70_000 + b" /v2/health/live HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\n\r\n")
        answer = b""
        while b"}" not in answer:
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 405"), answer[:100]
    assert b"XXX..." in answer and len(answer) < 1000, len(answer)
    huge_shape = b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1,99999999999999999999999],"data":[1]}]}'
    refused = httpx.post(f"{base}/v2/models/m/infer", content=huge_shape)
    assert refused.status_code == 400
    assert "99999999999999999999999" in refused.json()["error"]
    assert str(2**64 - 1) not in refused.json()["error"]
    named = infer_body([[1, 2, 3, 4]]).replace(b'"name": "x"', b'"name": "' + b"n" * 70_000 + b'"')
    refused = httpx.post(f"{base}/v2/models/m/infer", content=named)
    assert refused.status_code == 400 and "nnn..." in refused.json()["error"]
    assert len(refused.text) < 1000, len(refused.text)


def test_datatype_and_shape_are_checked_against_the_model_before_the_data_is_decoded(
    served: tuple[fb.Server, str],
) -> None:
    """An input of the wrong datatype or shape is refused, naming the input,
    what the model expects and what was sent, before its data is parsed
    (data that would not parse proves it: the refusal is the model's rule)."""
    server, base = served
    unparsable = '[1.5, 2.5, 3.5, "not a number"]'
    for datatype, shape, expected in [
        ("FP64", [1, 4], "input 'x': expected dtype float32, got float64"),
        ("FP32", [1, 5], "input 'x': expected shape (n, 4), got (1, 5)"),
    ]:
        body = f'{{"inputs":[{{"name":"x","datatype":"{datatype}","shape":{shape},"data":{unparsable}}}]}}'
        refused = httpx.post(f"{base}/v2/models/m/infer", content=body.encode())
        assert refused.status_code == 400
        assert refused.json()["error"] == expected
    # The data first, the header after: checked before the data is read too.
    body = '{"inputs":[{"data":' + unparsable + ',"name":"x","datatype":"FP64","shape":[1,4]}]}'
    refused = httpx.post(f"{base}/v2/models/m/infer", content=body.encode())
    assert refused.json()["error"] == "input 'x': expected dtype float32, got float64"
    assert outcomes(server)["invalid_input"] == 3


async def test_a_server_started_again_is_served_natively_and_not_ready_while_stopped() -> None:
    """A server the user stops and starts again under a running front-end:
    readiness says 503 while it is stopped, and its next run is served
    through that run's batcher (it was left on the stopped one: 503 for good)."""
    import asyncio

    from ferrobatch.serve import serve

    server = fb.Server(double, inputs=[X], outputs=[Y, N], name="again", max_delay=0)
    await server.start()  # the user's: serve() leaves it running
    stop = asyncio.Event()
    ready: asyncio.Future[Listening] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve([server], native(), on_ready=ready.set_result, stop=stop))
    listening = await asyncio.wait_for(ready, 30)
    body = infer_body([[1.0, 2.0, 3.0, 4.0]])
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{listening.http_port}", timeout=10) as http:
            assert (await http.post("/v2/models/again/infer", content=body)).status_code == 200
            await server.stop()
            assert (await http.get("/v2/models/again/ready")).status_code == 503
            assert (await http.post("/v2/models/again/infer", content=body)).status_code == 503
            await server.start()
            assert (await http.get("/v2/models/again/ready")).status_code == 200
            answer = await http.post("/v2/models/again/infer", content=body)
            assert answer.status_code == 200, answer.text
            assert answer.json()["outputs"][0]["data"] == [2.0, 4.0, 6.0, 8.0]
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        await server.stop()
    assert server.stats()["requests_succeeded"] == 2


def test_an_input_the_core_refuses_is_named_not_numbered() -> None:
    """A BYTES element past 16 MiB, refused where the request is queued:
    the message names the input, as the Python front-ends' does."""
    server = fb.Server(lambda b: {"t": b["t"]}, inputs=[T], outputs=[T], name="b")
    with serve_in_thread([server], native()) as listening:
        url = f"http://127.0.0.1:{listening.http_port}/v2/models/b/infer"
        element = "x" * (17 << 20)
        body = {"inputs": [{"name": "t", "datatype": "BYTES", "shape": [1, 1], "data": [element]}]}
        response = httpx.post(url, json=body, timeout=30)
    assert response.status_code == 400, response.text[:200]
    assert response.json()["error"].startswith("input 't': BYTES element 0 is"), response.text[:200]
