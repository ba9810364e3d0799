"""The weight sync between the pools: the collective broadcast (in turn and pipelined) against
the object store, on the same workers.

One one-step-off driver on a two-node Ray cluster on this machine (`bench.one_step_off`'s: the
trainer's ranks on one node, one rollout-pool rank with an HF engine on the other, all on the
CPU), with a model built from a config (`--hidden`, `--layers`). Its weights are synced to the
pool `--syncs` times by each path, the paths taken in turn round by round (this machine is
shared and noisy: a drift hits all three alike), through the trainer's own stage
(`trainer.stages.sync.sync_pool`): the object store (`checkpoint_engine.enable=false`), the
broadcast with each bucket received then loaded, and the pipelined broadcast
(`overlap_broadcast_and_consume=true`). After each sync the pool's weights are checked against
the trainer's (per-tensor sums).

    python -m bench.weight_sync [--hidden 512] [--layers 8] [--syncs 5] [--bucket-mb 64]

Prints, per path, the median wall time of a sync, the GB moved and the rate, and each path's
time as a ratio of the object store's. gloo over loopback on shared cores says little about
NCCL between GPU nodes; what it shows is the path's own cost (host copies, object-store puts
and gets) at equal bytes.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path
from typing import Any

from bench.one_step_off import overrides as one_step_off_overrides
from bench.one_step_off import pools_cluster

PATHS = {"object store": (False, False), "broadcast": (True, False), "broadcast, pipelined": (True, True)}


def overrides(model: Path, data: Path, run: Path, args: argparse.Namespace) -> list[str]:
    """`bench.one_step_off`'s driver (nothing is trained here: its batch and steps only size the
    driver), the HF engine, buckets of `--bucket-mb`."""
    sizes = argparse.Namespace(response_length=8, batch=4, steps=1, trainer_ranks=args.trainer_ranks)
    return [*one_step_off_overrides(model, data, run, sizes), "actor_rollout_ref.rollout.name=hf",
            f"actor_rollout_ref.rollout.update_weights_bucket_megabytes={args.bucket_mb}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--trainer-ranks", type=int, default=1)
    args = parser.parse_args()

    import ray

    from trainer.async_rl.one_step_off import OneStepOffDriver
    from trainer.config import load_config
    from trainer.config.async_training import CheckpointEngineConfig
    from trainer.stages.sync import sync_pool
    from trainer.tiny import save_tiny

    with pools_cluster("bench-weight-sync-", args.trainer_ranks, 1) as (root, _, data):
        model = save_tiny(root / "wide", seed=0, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                          num_hidden_layers=args.layers, num_attention_heads=8)
        driver = OneStepOffDriver(load_config(overrides(model, data, root / "run", args), env={}))
        times: dict[str, list[float]] = {name: [] for name in PATHS}
        sizes: dict[str, float] = {}
        try:
            pool = driver.stages.pool
            assert pool is not None
            actor_digest = driver.actor_group.run("weights_digest")[0]
            version = 0
            for _ in range(args.syncs + 1):  # the first round forms the group and warms the caches
                for name, (enable, overlap) in PATHS.items():
                    version += 1
                    noted: dict[str, Any] = {}
                    start = time.perf_counter()
                    sync_pool(driver.actor_group, pool, version, noted.__setitem__,
                              CheckpointEngineConfig(enable, overlap, 4096))
                    times[name].append(time.perf_counter() - start)
                    sizes[name] = noted["rollout_pool/weight_sync_gb"][0]
                    got = pool.run("weights_digest")[0]
                    assert all(math.isclose(got[k], v, rel_tol=1e-9, abs_tol=1e-9) for k, v in actor_digest.items()), name
        finally:
            ray.shutdown()
    base = statistics.median(times["object store"][1:])
    print(f"model: hidden {args.hidden}, {args.layers} layers; buckets of {args.bucket_mb} MiB; "
          f"{args.trainer_ranks} trainer rank(s) -> 1 pool rank (HF engine, CPU, gloo); "
          f"median of {args.syncs} syncs per path after a first, paths in turn")
    for name, ts in times.items():
        t = statistics.median(ts[1:])
        print(f"  {name:21s} {t:6.3f} s  {sizes[name]:.3f} GB  {sizes[name] / t:5.2f} GB/s  "
              f"x{t / base:.2f} of the object store's time")
    print("  pool weights equal to the trainer's after every sync: True")


if __name__ == "__main__":
    main()
