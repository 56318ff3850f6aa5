"""A FastAPI app whose route awaits ferrobatch: concurrent requests are
batched into one model call.

    python examples/fastapi_app.py          # or: uvicorn fastapi_app:app (from examples/)
    curl -X POST localhost:8000/predict -H 'content-type: application/json' \
         -d '{"features": [0.1, ...16 numbers]}'
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import torch
from _model import FEATURES, make_server
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, Field

import ferrobatch as fb


class Features(BaseModel):
    features: list[float] = Field(min_length=FEATURES, max_length=FEATURES)


class Prediction(BaseModel):
    probs: list[float]
    label: int


def make_app() -> FastAPI:
    server = make_server()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with server:  # started with the app, drained and stopped with it
            yield

    app = FastAPI(lifespan=lifespan)
    app.state.server = server
    client = server.client()

    @app.post("/predict")
    async def predict(request: Features) -> Prediction:
        try:
            out = await client.infer({"features": torch.tensor(request.features, dtype=torch.float32)}, timeout=1.0)
        except fb.QueueFullError:
            raise HTTPException(503, "busy, retry later") from None
        except fb.DeadlineExceededError:
            raise HTTPException(504, "timed out") from None
        probs = out["probs"]
        return Prediction(probs=probs.tolist(), label=int(probs.argmax()))

    @app.get("/stats")
    async def stats() -> dict[str, object]:
        return server.stats()

    return app


app = make_app()

if __name__ == "__main__":
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=8000)
