"""Slow nodes named: a node whose ranks take far longer than the others', step after step.

In a synchronous step every rank waits for the slowest at each collective, so one slow node (a
throttled GPU, a busy neighbour, a failing disk) slows the whole job without failing anything.
Which rank is slow cannot be read from the phases with collectives (log-probs and updates under
FSDP, a tensor-parallel engine): every rank's time there includes its wait for the slowest, so
all show the same. The rollout is the phase each engine runs alone, and its pace, seconds per
generated token (`dp/rank_<r>/gen_s` over `gen_tokens`, already recorded each step), does not
depend on how long the sampled responses happened to be. A node's pace is its slowest rank's. A
node whose pace is more than `trainer.watchdog.slow_factor` times the median of the other
nodes' for `trainer.watchdog.slow_steps` steps in a row is named once: in the log, and as a
diagnosis of kind `slow` (`<run_dir>/diagnosis.jsonl`), which `hpcrl status` shows. Nothing is
stopped here: a slow node is not a broken one. The run goes on, unless the job was submitted with
`--exclude-slow`: hpcrl's head agent then checkpoints and requeues it without the node when it can
(:mod:`hpcrl.agent.slow`).

A rollout pool's nodes (the one-step-off and fully-async loops) are watched the same way, their
ranks' paces (`rollout_pool/rank_<r>/gen_s` over `gen_tokens`) compared among themselves.

Every step also logs each node's pace (`perf/node/<host>/gen_s_per_token`), so the plot of a
run shows a node falling behind before it is named.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["POOL_RANKS", "TRAINER_RANKS", "SlowNode", "StragglerWatch", "rank_pace"]


@dataclass(frozen=True)
class SlowNode:
    host: str
    ranks: tuple[int, ...]
    pace: float
    """Its pace in the last step (its slowest rank's seconds per generated token)."""
    others: float
    """The median of the other nodes' paces in that step."""
    steps: int
    """Steps in a row it was past the bound."""

    def summary(self, factor: float) -> str:
        ranks = ", ".join(str(r) for r in self.ranks)
        return (f"node `{self.host}` (rank(s) {ranks}) is slow: its rollout took {self.pace * 1e3:.2f} ms per "
                f"generated token in the last step against a median of {self.others * 1e3:.2f} ms on the other "
                f"nodes, more than {factor:g}x for {self.steps} steps in a row; every step waits for it. Fix: check "
                "the node (its GPUs' clocks and temperature, other jobs on it), or leave it out: `hpcrl submit "
                "--exclude-slow` (profile `slurm.exclude_slow`) requeues the job without it when a spare node is "
                f"idle; by hand, `--exclude={self.host}` in `slurm.extra_sbatch` and `hpcrl submit --resume "
                "--update-spec --run-dir RUN`")


TRAINER_RANKS = "dp/rank_{rank}/{phase}"
"""The key of a trainer rank's figure of a step."""
POOL_RANKS = "rollout_pool/rank_{rank}/{phase}"
"""The key of a rollout-pool rank's figure (the one-step-off and fully-async loops, where the
trainer's ranks generate nothing and the pool's nodes are compared among themselves)."""


def rank_pace(rank_metrics: Mapping[str, float], world: int, key: str = TRAINER_RANKS) -> list[float | None]:
    """Each rank's rollout pace in a step: `gen_s` / `gen_tokens` under `key` (None: no tokens)."""
    out: list[float | None] = []
    for rank in range(world):
        tokens = rank_metrics.get(key.format(rank=rank, phase="gen_tokens"), 0.0)
        seconds = rank_metrics.get(key.format(rank=rank, phase="gen_s"))
        out.append(float(seconds) / float(tokens) if seconds is not None and tokens > 0 else None)
    return out


class StragglerWatch:
    """Per-node times of each step, and the nodes past the bound for long enough."""

    def __init__(self, nodes: Sequence[Mapping[str, Any]], factor: float, steps: int, key: str = TRAINER_RANKS
                 ) -> None:
        self.hosts, self.key = [str(n.get("hostname", "?")) for n in nodes], key
        self.factor, self.steps = factor, steps
        self.streak: dict[str, int] = {}
        self.named: set[str] = set()

    def observe(self, rank_metrics: Mapping[str, float]) -> tuple[dict[str, float], list[SlowNode]]:
        """This step's per-node metrics, and the nodes named slow at this step (each once per run)."""
        per_node: dict[str, float] = {}
        ranks: dict[str, list[int]] = {}
        for rank, (host, pace) in enumerate(zip(self.hosts, rank_pace(rank_metrics, len(self.hosts), self.key), strict=True)):
            ranks.setdefault(host, []).append(rank)
            if pace is not None:
                per_node[host] = max(per_node.get(host, 0.0), pace)
        metrics = {f"perf/node/{host}/gen_s_per_token": value for host, value in per_node.items()}
        slow: list[SlowNode] = []
        if len(per_node) < 2:  # one node: nothing to compare with
            return metrics, slow
        for host, value in per_node.items():
            others = statistics.median(v for h, v in per_node.items() if h != host)
            past = others > 0 and value > self.factor * others
            self.streak[host] = self.streak.get(host, 0) + 1 if past else 0
            if self.streak[host] >= self.steps and host not in self.named:
                self.named.add(host)
                slow.append(SlowNode(host, tuple(ranks[host]), value, others, self.streak[host]))
        return metrics, slow
