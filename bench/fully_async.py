"""The fully-async loop with its rollouter running ahead against the same loop held to its trainer.

Both runs are `trainer.async_rl.fully_async.FullyAsyncDriver` on the same two-node Ray cluster on
this machine (`ray.cluster_utils.Cluster`; the trainer's ranks on one node, the rollout pool's
ranks on the other, computing on the CPU), with the same data, seeds and sizes; only
`async_training.staleness_threshold` differs:

- held (`0`): verl's `max_required_samples` is exactly the prompts of one sync interval, so the
  rollouter generates an interval's prompts and pauses until the sync; generation and training
  take turns;
- ahead (`--staleness`, default 1): the rollouter may generate a whole further interval while
  the trainer trains, each sample at most one version behind.

    python -m bench.fully_async [--steps 6] [--response-length 48] [--pool-ranks 2]

Prints each run's median step time with its weight sync (steps 2 onwards; the sync waits for the
calls in flight to finish, so a wait moved out of the step shows there), the trainer's wait for
samples and the rollouter's idle share, the samples' lag, and the ratio of step times. The batches differ between
the runs (a sample's weights depend on when it was generated), so the ratio is of wall time per
step, not of identical work; on this machine's 2 cores the pool and the trainer compete for the
same CPUs, so the gain is bounded by what the cores leave idle.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any


def overrides(model: Path, data: Path, run: Path, args: argparse.Namespace, staleness: float) -> list[str]:
    return [
        f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'test.parquet'}",
        "data.max_prompt_length=16", f"data.max_response_length={args.response_length}",
        f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.actor.optim.lr=1e-3",
        "trainer.val_before_train=false", "algorithm.adv_estimator=grpo", f"trainer.default_local_dir={run}",
        "trainer.logger=jsonl", "data.train_batch_size=0", "data.gen_batch_size=1",
        "actor_rollout_ref.rollout.n=4", f"actor_rollout_ref.actor.ppo_mini_batch_size={args.batch}",
        "trainer.save_freq=-1", f"rollout.total_rollout_steps={args.steps * args.batch}",
        "actor_rollout_ref.hybrid_engine=false", "rollout.nnodes=1", f"rollout.n_gpus_per_node={args.pool_ranks}",
        "trainer.nnodes=1", f"trainer.n_gpus_per_node={args.trainer_ranks}", "trainer.device=cpu",
        "actor_rollout_ref.rollout.calculate_log_probs=true", "actor_rollout_ref.rollout.mode=async",
        "algorithm.rollout_correction.bypass_mode=true", "async_training.partial_rollout=false",
        "async_training.trigger_parameter_sync_step=1", f"async_training.staleness_threshold={staleness}",
    ]


def run(name: str, staleness: float, args: argparse.Namespace, model: Path, data: Path, root: Path) -> dict[str, Any]:
    import ray

    from trainer.async_rl.fully_async import FullyAsyncDriver
    from trainer.config import load_config
    from trainer.metrics import read_jsonl

    out = root / name
    driver = FullyAsyncDriver(load_config(overrides(model, data, out, args, staleness), env={}))
    start = time.perf_counter()
    try:
        assert driver.fit() == 0
    finally:
        ray.shutdown()
    total = time.perf_counter() - start
    rows = read_jsonl(out / "metrics.jsonl")[1:]
    # a version's wall time: its updates (`timing_s/step`, summed) and the sync, which waits for
    # the calls in flight to finish (verl's pause without partial rollout)
    return {"step_s": statistics.median(r["timing_s/step"] + r["timing_s/param_sync"] for r in rows),
            "sync_s": statistics.median(r["timing_s/param_sync"] for r in rows),
            "wait_s": statistics.median(r["timing_s/gen"] for r in rows),
            "idle": statistics.median(r["fully_async/rollouter/idle_ratio"] for r in rows),
            "lag": max(r["fully_async/lag/max"] for r in rows), "total_s": total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=8, help="prompts per update (ppo_mini_batch_size)")
    parser.add_argument("--response-length", type=int, default=48)
    parser.add_argument("--trainer-ranks", type=int, default=1)
    parser.add_argument("--pool-ranks", type=int, default=2)
    parser.add_argument("--staleness", type=float, default=1.0)
    args = parser.parse_args()

    from bench.one_step_off import pools_cluster

    with pools_cluster("bench-fully-async-", args.trainer_ranks, args.pool_ranks) as (root, model, data):
        held = run("held", 0.0, args, model, data, root)
        ahead = run("ahead", args.staleness, args, model, data, root)
    print(f"steps {args.steps}, {args.batch} prompts x 4 samples per update, a sync per update, responses up to "
          f"{args.response_length} tokens, {args.trainer_ranks} trainer rank(s) + {args.pool_ranks} pool ranks; "
          f"medians over steps 2-{args.steps}")
    for name, r in (("held (0)", held), (f"ahead ({args.staleness:g})", ahead)):
        print(f"  {name:12s} step with its sync {r['step_s']:.2f} s  sync {r['sync_s']:.2f} s  "
              f"trainer's wait {r['wait_s']:.2f} s  "
              f"rollouter idle {r['idle']:.2f}  max lag {r['lag']:.0f}  run {r['total_s']:.1f} s")
    print(f"  ahead / held, step time: {ahead['step_s'] / held['step_s']:.2f}")


if __name__ == "__main__":
    main()
