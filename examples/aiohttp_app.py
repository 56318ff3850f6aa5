"""An aiohttp app that starts and stops a ferrobatch server with ``cleanup_ctx``,
awaits it from its own route, and serves it over the Open Inference Protocol
as a sub-app under /triton.

    python examples/aiohttp_app.py
    curl -X POST localhost:8000/predict -d '{"features": [0.1, ...16 numbers]}'
    curl localhost:8000/triton/v2/models/scorer
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import torch
from _model import FEATURES, make_server
from aiohttp import web

import ferrobatch as fb
from ferrobatch.http import aiohttp_app

SERVER = web.AppKey("server", fb.Server)


async def predict(request: web.Request) -> web.Response:
    body = await request.json()
    features = torch.tensor(body.get("features", []), dtype=torch.float32)
    if features.shape != (FEATURES,):
        return web.json_response({"error": f"'features' must be {FEATURES} numbers"}, status=400)
    client = request.app[SERVER].client()
    try:
        out = await client.infer({"features": features}, timeout=1.0)
    except fb.QueueFullError:
        return web.json_response({"error": "busy, retry later"}, status=503)
    except fb.DeadlineExceededError:
        return web.json_response({"error": "timed out"}, status=504)
    probs = out["probs"]
    return web.json_response({"probs": probs.tolist(), "label": int(probs.argmax())})


async def run_server(app: web.Application) -> AsyncIterator[None]:
    # Runs before the app accepts requests; resumes at cleanup to drain and stop.
    async with app[SERVER]:
        yield


def make_app() -> web.Application:
    app = web.Application()
    app[SERVER] = server = make_server()
    app.cleanup_ctx.append(run_server)
    app.router.add_post("/predict", predict)
    app.add_subapp("/triton", aiohttp_app(server, manage_servers=False))
    return app


if __name__ == "__main__":
    web.run_app(make_app(), host="127.0.0.1", port=8000)
