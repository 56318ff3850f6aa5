"""Ray Serve: ferrobatch batching on both sides of the hop.

    app = ferrobatch.ray.deployment(make_server, name="mlp", num_replicas=2)
    handle = serve.run(app)
    out = await handle.infer.remote({"x": x})         # each replica batches what reaches it
    client = ferrobatch.ray.client(handle)            # batches before the hop:
    out = await client.infer({"x": x})                # one handle call per batch

Needs ``ray[serve]`` (``pip install "ferrobatch[ray]"``).
"""

try:
    import ray.serve  # noqa: F401 - the top-level ray, not this package
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("ferrobatch.ray needs Ray Serve: pip install 'ferrobatch[ray]' (or 'ray[serve]')") from exc

from ._autoscaling import QueueDepthPolicy
from ._client import RayClient, client
from ._deployment import DEFAULT_MAX_ONGOING_REQUESTS, FerrobatchReplica, deployment

__all__ = ["DEFAULT_MAX_ONGOING_REQUESTS", "FerrobatchReplica", "QueueDepthPolicy", "RayClient", "client", "deployment"]
