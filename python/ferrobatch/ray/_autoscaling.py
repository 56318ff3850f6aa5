"""Ray Serve's autoscaler, driven by ferrobatch's queue depth.

Ray runs the policy in its controller and pickles it by value (this module is
registered with cloudpickle for that), so it uses nothing but the standard
library: the controller need not have ferrobatch or torch installed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CAPACITY", "QUEUE_DEPTH", "QueueDepthPolicy"]

#: The metrics each replica reports (``record_autoscaling_stats``): requests
#: waiting in its batcher now, and ``max_batch_size`` x instances.
QUEUE_DEPTH = "ferrobatch_queue_depth"
CAPACITY = "ferrobatch_capacity"


class QueueDepthPolicy:
    """Asks for as many replicas as keep about ``target_queue_depth``
    requests waiting in each replica's batcher (averaged over Ray's
    ``look_back_period_s``); ``None``: one full batch per instance
    (``max_batch_size`` x instances, as each replica reports it).

    A replica that keeps up holds less than one batch per instance between
    dispatches; more than that waiting means every worker is busy and a
    whole batch is already queued behind it. Ray applies ``min_replicas``,
    ``max_replicas``, the up/downscale delays and factors to the answer.
    """

    def __init__(self, target_queue_depth: float | None = None) -> None:
        if target_queue_depth is not None and not target_queue_depth > 0:
            raise ValueError(f"target_queue_depth must be > 0, got {target_queue_depth!r}")
        self.target_queue_depth = target_queue_depth

    def desired_replicas(self, depths: dict[Any, float], capacities: dict[Any, float], current: int) -> float:
        """Replicas wanted for these per-replica queue depths (replicas that
        reported nothing yet count as idle)."""
        if not depths:
            return float(current)
        wanted = 0.0
        for replica, depth in depths.items():
            target = self.target_queue_depth or capacities.get(replica) or 1.0
            wanted += max(0.0, depth) / target
        return wanted

    def __call__(self, ctx: Any) -> tuple[float, dict[str, Any]]:
        metrics = ctx.aggregated_metrics or {}
        depths = {r: v for r, v in metrics.get(QUEUE_DEPTH, {}).items() if r in set(ctx.running_replicas)}
        if ctx.current_num_replicas == 0 or not depths:
            return ctx.target_num_replicas, {}
        return self.desired_replicas(depths, metrics.get(CAPACITY, {}), ctx.current_num_replicas), {}
