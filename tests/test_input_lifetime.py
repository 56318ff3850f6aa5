"""A queued request keeps its inputs' bytes whatever the caller then does to its objects."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# Run in a child process: before the fix, reading freed memory could kill the
# interpreter (4 MiB samples are unmapped when freed), which must show as a
# failed test, not a crashed suite.
SCRIPT = textwrap.dedent(
    """
    import asyncio, threading
    import numpy as np
    import torch
    import ferrobatch as fb

    N = 1 << 20  # 4 MiB of float32 per sample
    entered, release = threading.Event(), threading.Event()

    def model(d):
        x = d["x"]
        if not entered.is_set():
            entered.set()
            release.wait(30)
        return {"y": torch.stack([x[:, 0], x[:, -1], x.sum(1, dtype=torch.float64).float()], 1)}

    def churn():
        # Reuse the memory the caller's objects gave back, so a stale read shows.
        return [torch.full((N,), -1.0) for _ in range(8)]

    async def main():
        server = fb.Server(model, inputs=[fb.TensorSpec("x", "float32", (N,))],
                           outputs=[fb.TensorSpec("y", "float32", (3,))],
                           max_batch_size=1, max_delay=0.0)
        async with server:
            client = server.client()
            blocker = asyncio.ensure_future(client.infer({"x": torch.zeros(N)}))
            while not entered.is_set():
                await asyncio.sleep(0.001)
            resized, swapped, replaced = (torch.full((N,), float(i)) for i in (1, 2, 3))
            values = [resized, swapped, replaced, np.full(N, 4.0, np.float32)]
            tasks = [asyncio.ensure_future(client.infer({"x": v})) for v in values]
            await asyncio.sleep(0)  # every request is submitted (queued behind the blocker)
            resized.resize_(4 * N)  # reallocates the storage it shared
            swapped.set_(torch.empty(0).untyped_storage())
            replaced.data = torch.zeros(3)
            values[3].resize((4 * N,), refcheck=False)  # numpy's own unchecked resize
            del values
            garbage = churn()
            release.set()
            await blocker
            for i, task in enumerate(tasks, start=1):
                y = (await task)["y"].tolist()
                assert y == [float(i), float(i), float(i) * N], (i, y)
            del garbage
        print("ok")

    asyncio.run(main())
    """
)


def test_resizing_or_replacing_an_input_while_its_request_is_queued_changes_nothing() -> None:
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=240)
    assert result.returncode == 0 and result.stdout.strip() == "ok", (
        f"exit status {result.returncode}\n{result.stdout}\n{result.stderr[-3000:]}"
    )
