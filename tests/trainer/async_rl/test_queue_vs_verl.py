"""The queue's sizes, admission and recount against verl 0.9.1's own code, on random runs.

Each run (:func:`tests.trainer.async_rl.simulate.simulate`: random finishing order, drained or
partial syncs, thresholds from 0 to 2.5) is replayed by `verl_queue_side.py` in verl's
interpreter on `FullyAsyncRollouter.set_max_required_samples`, `_should_pause_generation`,
`reset_staleness` and verl's `MessageQueue`: verl's sizes, its answer at every admission check,
the queue's size after every event and `staleness_samples` after every sync must be this
module's."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.trainer.async_rl.simulate import simulate
from tests.trainer.async_rl.test_queue import bounds
from tests.verl_env import verl_python

SIDE = Path(__file__).with_name("verl_queue_side.py")
CONFIGS = [(4, 1, 0.0, 1), (4, 1, 0.5, 2), (2, 2, 1.0, 2), (3, 1, 2.5, 1), (8, 1, 0.1, 4), (5, 1, 0.3, 3)]


def test_queue_rules_match_verls(tmp_path: Path) -> None:
    scenarios, runs = [], []
    for i, (mini, require, threshold, trigger) in enumerate(CONFIGS * 2):
        total = 150 + 7 * i
        b = bounds(mini, require, threshold, trigger, total)
        run = simulate(b, prompts=total, seed=i, partial_rollout=i % 2 == 1)
        runs.append((b, run))
        scenarios.append({"ppo_mini_batch_size": mini, "require_batches": require, "staleness_threshold": threshold,
                          "trigger": trigger, "total_rollout_steps": total, "events": run.events})
    (tmp_path / "in.json").write_text(json.dumps(scenarios))
    subprocess.run([verl_python(), str(SIDE), str(tmp_path / "in.json"), str(tmp_path / "out.json")], check=True,
                   stdout=subprocess.DEVNULL)
    for (b, run), verl in zip(runs, json.loads((tmp_path / "out.json").read_text()), strict=True):
        assert (verl["max_required_samples"], verl["max_queue_size"], verl["total_train_steps"]) == (
            b.max_required_samples, b.max_queue_size, b.total_train_steps)
        assert verl["pauses"] == run.pauses and True in run.pauses  # admission was tested, refusals included
        assert verl["queue_sizes"] == run.queue_sizes
        assert verl["after_sync"] == run.after_sync and run.after_sync
        assert verl["dropped"] == run.queue.dropped == 0
