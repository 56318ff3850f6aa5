"""TorchRL-style actors in threads share one batched policy while a trainer
updates its weights: every action carries the policy version that computed it.

    python examples/torchrl_actors.py
"""

from __future__ import annotations

import threading
import time

import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule

from ferrobatch.torchrl import InferenceServer, ThreadingTransport

OBS, ACTIONS = 8, 3


def make_policy() -> TensorDictModule:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(OBS, 32), torch.nn.Tanh(), torch.nn.Linear(32, ACTIONS))
    return TensorDictModule(net, in_keys=["observation"], out_keys=["logits"])


def run(actors: int = 8, steps: int = 200, updates: int = 5) -> dict[str, float | int]:
    """Runs ``actors`` threads for ``steps`` environment steps each while a
    trainer pushes ``updates`` weight updates; returns the server's stats,
    with the versions the actors saw."""
    policy = make_policy()
    trainer_copy = make_policy()  # the trainer's own copy, whose weights it pushes
    transport = ThreadingTransport()
    versions: list[int] = []
    with InferenceServer(policy, transport, max_batch_size=64) as server:

        def actor(seed: int) -> None:
            client = transport.client()
            generator = torch.Generator().manual_seed(seed)
            obs = torch.randn(OBS, generator=generator)
            for _ in range(steps):
                td = client(TensorDict({"observation": obs}))
                action = int(td["logits"].argmax())
                versions.append(int(td["policy_version"]))
                obs = torch.roll(obs, action) + 0.1 * torch.randn(OBS, generator=generator)  # a toy environment

        def trainer() -> None:
            for _ in range(updates):
                with torch.no_grad():  # a stand-in for an optimiser step
                    for p in trainer_copy.parameters():
                        p.add_(0.01 * torch.randn_like(p))
                weights = trainer_copy.state_dict()
                # Between batches, never during one; the version goes up by one.
                server.update_model(lambda m, w=weights: m.load_state_dict(w))
                time.sleep(0.02)  # the next training step

        threads = [threading.Thread(target=actor, args=(i,)) for i in range(actors)]
        threads.append(threading.Thread(target=trainer))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stats = server.stats()
    return {**stats, "versions_seen": len(set(versions)), "steps": len(versions)}


if __name__ == "__main__":
    stats = run()
    print(
        f"{stats['steps']} steps in {stats['batches']} batches (mean {stats['avg_batch_size']:.1f} per batch);"
        f" {stats['weight_updates']} weight updates, final policy version {stats['policy_version']},"
        f" actions from {stats['versions_seen']} versions"
    )
