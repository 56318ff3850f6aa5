"""A Starlette app that batches its own route's model calls with ferrobatch,
and also serves the model over the Open Inference Protocol under /v2.

    python examples/starlette_app.py        # or: uvicorn starlette_app:app (from examples/)
    curl -X POST localhost:8000/predict -d '{"features": [0.1, ...16 numbers]}'
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import torch
from _model import FEATURES, make_server
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Mount, Route

import ferrobatch as fb
from ferrobatch.http import starlette_app


def make_app() -> Starlette:
    server = make_server()
    client = server.client()

    async def predict(request: Request) -> JSONResponse:
        body = await request.json()
        features = torch.tensor(body.get("features", []), dtype=torch.float32)
        if features.shape != (FEATURES,):
            return JSONResponse({"error": f"'features' must be {FEATURES} numbers"}, 400)
        try:
            # One sample; ferrobatch batches it with concurrent requests.
            out = await client.infer({"features": features}, timeout=1.0)
        except fb.QueueFullError:
            return JSONResponse({"error": "busy, retry later"}, 503)
        except fb.DeadlineExceededError:
            return JSONResponse({"error": "timed out"}, 504)
        probs = out["probs"]
        return JSONResponse({"probs": probs.tolist(), "label": int(probs.argmax())})

    async def stats(request: Request) -> JSONResponse:
        return JSONResponse(server.stats())

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # The app's lifespan owns the server: started before the first request,
        # stopped (draining accepted requests) at shutdown.
        async with server:
            yield

    app = Starlette(
        routes=[
            Route("/predict", predict, methods=["POST"]),
            Route("/stats", stats),
            # Mounted apps get no lifespan of their own: the server is ours.
            Mount("/", starlette_app(server, manage_servers=False)),
        ],
        lifespan=lifespan,
    )
    app.state.server = server
    return app


app = make_app()

if __name__ == "__main__":
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=8000)
