"""A Starlette app whose worker processes share one model process.

Each ``uvicorn --workers N`` worker connects to the model shared by another
process instead of loading a copy of its own: requests from every worker
join the same batches, and the GPU (or the CPU's caches) holds one model.

    # the model process (from examples/): the model of _model.py, shared as "scorer"
    ferrobatch serve _model:make_server --share scorer --no-grpc --http-port 8001
    # the web app, two workers, each a client of that one model
    FERROBATCH_SHARE=scorer uvicorn shared_starlette:app --workers 2 --port 8000
    curl -X POST localhost:8000/predict -d '{"features": [0.1, ...16 numbers]}'
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator

import torch
from _model import FEATURES
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

import ferrobatch as fb

SHARE = os.environ.get("FERROBATCH_SHARE", "scorer")


def make_app() -> Starlette:
    clients: list[fb.SharedClient] = []

    async def predict(request: Request) -> JSONResponse:
        body = await request.json()
        features = torch.tensor(body.get("features", []), dtype=torch.float32)
        if features.shape != (FEATURES,):
            return JSONResponse({"error": f"'features' must be {FEATURES} numbers"}, 400)
        try:
            # One sample, sent to the model process; batched there with the
            # requests of every worker.
            out = await clients[0].infer({"features": features}, timeout=1.0)
        except fb.QueueFullError:
            return JSONResponse({"error": "busy, retry later"}, 503)
        except fb.DeadlineExceededError:
            return JSONResponse({"error": "timed out"}, 504)
        except fb.ServerClosedError:
            return JSONResponse({"error": "the model process is not running"}, 503)
        probs = out["probs"]
        return JSONResponse({"probs": probs.tolist(), "label": int(probs.argmax()), "worker": os.getpid()})

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # Each worker connects once, at start-up (waiting up to 30 s for the
        # model process), and gives its slot back at shutdown.
        with fb.connect(SHARE, timeout=30.0) as client:
            clients.append(client)
            yield

    return Starlette(routes=[Route("/predict", predict, methods=["POST"])], lifespan=lifespan)


app = make_app()
