"""One-step-off against the same run without the overlap: wall time per step on a rollout pool.

Both runs use the same separate deployment on a two-node Ray cluster on this machine
(`ray.cluster_utils.Cluster`; the trainer's ranks on one node, the rollout pool's on the other,
computing on the CPU), the same seeds and the same weights for every batch: one-step-off
(`trainer.async_rl.one_step_off.OneStepOffDriver`) starts batch k+1's generation before it
trains on batch k; the baseline starts it only when step k+1 asks for it, after batch k's
training, so generation and training take turns. Both runs therefore train on identical
batches (checked: their per-step scores must match), and the ratio of their step times is the
overlap's gain alone.

    python -m bench.one_step_off [--steps 6] [--response-length 48] [--trainer-ranks 1]

Prints each run's median step time (steps 2 onwards: step 1 has nothing to overlap), the
generation's own time and the trainer's wait for it, and the ratio. On this machine's 2 cores
the pool and the trainer compete for the same CPUs, so the gain is bounded by what the cores
leave idle; on GPU nodes each pool has its own devices.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from trainer.async_rl.one_step_off import OneStepOffDriver


class Deferred(Future):  # type: ignore[type-arg]
    """A generation run only when its result is asked for (no overlap)."""

    def __init__(self, fn: Any, *args: Any) -> None:
        super().__init__()
        self.fn, self.args = fn, args

    def result(self, timeout: float | None = None) -> Any:
        if not self.done():
            self.set_result(self.fn(*self.args))
        return super().result(timeout)


class TakingTurns(OneStepOffDriver):
    """The same loop, generation deferred until the next step waits for it."""

    def _start(self, step: int) -> Any:
        return Deferred(self.stages.sample_ahead, self.loader.next_batch(), step)


def overrides(model: Path, data: Path, run: Path, args: argparse.Namespace) -> list[str]:
    return [
        f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'test.parquet'}",
        "data.max_prompt_length=16", f"data.max_response_length={args.response_length}",
        f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.actor.optim.lr=1e-3",
        "trainer.val_before_train=false", "algorithm.adv_estimator=grpo", f"trainer.default_local_dir={run}",
        "trainer.logger=jsonl", f"data.train_batch_size={args.batch}", "actor_rollout_ref.rollout.n=4",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.batch}", "trainer.save_freq=-1",
        f"trainer.total_training_steps={args.steps}", "actor_rollout_ref.hybrid_engine=false",
        "rollout.nnodes=1", "rollout.n_gpus_per_node=1", "trainer.nnodes=1",
        f"trainer.n_gpus_per_node={args.trainer_ranks}", "trainer.device=cpu",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
    ]


def run(cls: type[OneStepOffDriver], args: argparse.Namespace, model: Path, data: Path, root: Path) -> dict[str, Any]:
    import ray

    from trainer.config import load_config
    from trainer.metrics import read_jsonl

    out = root / cls.__name__
    driver = cls(load_config(overrides(model, data, out, args), env={}))
    start = time.perf_counter()
    try:
        assert driver.fit() == 0
    finally:
        ray.shutdown()
    total = time.perf_counter() - start
    rows = read_jsonl(out / "metrics.jsonl")[1:]
    return {"step_s": statistics.median(r["timing_s/step"] for r in rows),
            "gen_async_s": statistics.median(r["timing_s/generate_async"] for r in rows),
            "wait_s": statistics.median(r["timing_s/gen"] for r in rows),
            "total_s": total, "scores": [round(r["critic/score/mean"], 6) for r in rows]}


@contextmanager
def pools_cluster(prefix: str, trainer_gpus: int, pool_gpus: int) -> Iterator[tuple[Path, Path, Path]]:
    """A two-node Ray cluster on this machine (the trainer's node declaring `trainer_gpus`, the
    pool's `pool_gpus`, one CPU per GPU there), RAY_ADDRESS pointing at it, and a temporary
    directory with the tiny model and the toy data: (directory, model, data)."""
    import os

    from ray.cluster_utils import Cluster

    from trainer.rewards.toy import write_toy_digits
    from trainer.tiny import save_tiny
    from trainer.workers.ray_group import private_token_auth

    for name in ("RAY_ADDRESS", "CUDA_VISIBLE_DEVICES"):
        os.environ.pop(name, None)
    private_token_auth()
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        root = Path(tmp)
        model = save_tiny(root / "model", seed=0)
        write_toy_digits(root / "data", train_size=256, val_size=8, seed=0)
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": trainer_gpus,
                                                                "include_dashboard": False})
        cluster.add_node(num_cpus=pool_gpus, num_gpus=pool_gpus)
        cluster.wait_for_nodes()
        os.environ["RAY_ADDRESS"] = cluster.address
        try:
            yield root, model, root / "data"
        finally:
            cluster.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--response-length", type=int, default=48)
    parser.add_argument("--trainer-ranks", type=int, default=1)
    args = parser.parse_args()

    with pools_cluster("bench-one-step-off-", args.trainer_ranks, 1) as (root, model, data):
        turns = run(TakingTurns, args, model, data, root)
        ahead = run(OneStepOffDriver, args, model, data, root)
    same = turns["scores"] == ahead["scores"]
    print(f"steps {args.steps}, batch {args.batch} x 4 samples, responses up to {args.response_length} tokens, "
          f"{args.trainer_ranks} trainer rank(s) + 1 pool rank; medians over steps 2-{args.steps}")
    for name, r in (("taking turns", turns), ("one-step-off", ahead)):
        print(f"  {name:13s} step {r['step_s']:.2f} s  generation {r['gen_async_s']:.2f} s  "
              f"trainer's wait {r['wait_s']:.2f} s  run {r['total_s']:.1f} s")
    print(f"  one-step-off / taking turns, step time: {ahead['step_s'] / turns['step_s']:.2f}")
    print(f"  identical batches (per-step scores equal): {same}")


if __name__ == "__main__":
    main()
