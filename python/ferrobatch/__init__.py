"""ferrobatch: asyncio-native auto-batching of model inference, with a Rust hot path.

server = fb.Server(model, inputs=[fb.TensorSpec("x", "float32", (256,))],
                   outputs=[fb.TensorSpec("y", "float32", (256,))])
async with server:
    out = await server.client().infer({"x": torch.randn(256)})
"""

from ._cache import ResponseCache
from ._core import __version__
from ._executor import RequestsFailed
from ._requests import RequestInfo
from .client import Client
from .errors import (
    DeadlineExceededError,
    FerrobatchError,
    InvalidInputError,
    ModelError,
    QueueFullError,
    ServerClosedError,
    StreamBacklogError,
)
from .server import Server
from .shared import Shared, SharedClient, connect
from .specs import TensorSpec

__all__ = [
    "Client",
    "DeadlineExceededError",
    "FerrobatchError",
    "InvalidInputError",
    "ModelError",
    "QueueFullError",
    "RequestInfo",
    "RequestsFailed",
    "ResponseCache",
    "Server",
    "ServerClosedError",
    "Shared",
    "SharedClient",
    "StreamBacklogError",
    "TensorSpec",
    "__version__",
    "connect",
]
