"""The model directory's entry point for the ferrobatch runtime: `ferrobatch serve model:server`
runs in this directory (KServe's /mnt/models) and serves what `server` returns.

This example serves the built-in demo MLP as "mlp" ({"x": float32[256]} -> {"y": float32[256]});
replace it with your model, e.g. torch.load / load_state_dict from a file beside this one.
"""

from ferrobatch.demo import make_demo_server


def server():  # a function: `ferrobatch serve` builds the Server in the serving process
    return make_demo_server(name="mlp")
