"""Trajectories over several server-mode replicas: prompts split by rank, verl's balancer, and
trajectories dealt in turn (:func:`trainer.stages.rollout.deal`), on long-tailed trajectories.

    python -m bench.replica_dealing [--replicas 4] [--prompts 64] [--n 4] [--turns 3] [--max-num-seqs 8]
        [--sigma-prompt 1.0] [--sigma-turn 0.5] [--median-tokens 64] [--max-tokens 1024] [--step-ms 1.0]
        [--tool-ms 20] [--seed 0] [--seeds 6]

A scheduling measurement, not an engine one: this machine has no devices, and vLLM replicas on
its 2 cores would share the same compute (bench/README.md, "Agent-loop turns"). Each replica is
simulated as a continuous-batching engine: at most `--max-num-seqs` requests run at once (vLLM's
`max_num_seqs`; the rest wait in its queue, first come first served), and a request of `t` tokens
runs `t` decode steps of `--step-ms` each, however many others run beside it (a device's decode
step costs about the same at small batch). A trajectory is `--turns` turns with a `--tool-ms`
tool call between them; its tokens per turn are lognormal, with a factor per prompt (a hard prompt
makes all its `--n` samples long: `--sigma-prompt`) and per turn (`--sigma-turn`), cut to
`--max-tokens`. The same draws run in every mode:

- `per-rank`: the prompts split in contiguous shares, one per replica, every trajectory of a
  share started at once on its replica (the trainer before :mod:`trainer.agent.dispatch`);
- `verl`: every trajectory started at once, each on the server :class:`trainer.agent.servers.ServerPool`
  picks for its first turn (least requests in flight, then sticky), verl's balancer;
- `dealt`: :func:`trainer.stages.rollout.deal`, the trainer's: trajectory `t` to replica
  `t % replicas`, all started at once, each whole on its replica.

Figures: wall time of the rollout, p50/p99 of a trajectory's time from the rollout's start to
its end, each replica's idle fraction (no request running or queued; mean and max over
replicas), and each mode's wall time over `per-rank`'s; then each mode's mean over `--seeds`
workloads. `bound`: the busiest possible replica if
the work (decode steps, in slots) were spread perfectly, a floor no mode can beat.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from trainer.agent.base import TokenOutput
from trainer.agent.servers import ServerPool
from trainer.rollout.base import SamplingParams
from trainer.stages.rollout import deal


@dataclass
class SimEngine:
    """A replica: `slots` requests at once, `step_s` per generated token; busy time recorded."""

    slots: int
    step_s: float
    sem: asyncio.Semaphore = field(init=False)
    active: int = 0
    busy_since: float | None = None
    busy: float = 0.0

    def __post_init__(self) -> None:
        self.sem = asyncio.Semaphore(self.slots)

    def _enter(self) -> None:
        if self.active == 0:
            self.busy_since = time.perf_counter()
        self.active += 1

    def _leave(self) -> None:
        self.active -= 1
        if self.active == 0 and self.busy_since is not None:
            self.busy += time.perf_counter() - self.busy_since

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       max_tokens: int) -> TokenOutput:
        self._enter()  # queued counts as busy: the engine has work
        try:
            async with self.sem:
                await asyncio.sleep(max_tokens * self.step_s)
            return TokenOutput(token_ids=[0] * max_tokens)
        finally:
            self._leave()


def workload(args: argparse.Namespace) -> list[list[int]]:
    """Tokens per turn of every trajectory (prompt-major, `n` samples each)."""
    draw = random.Random(args.seed)
    out = []
    for _ in range(args.prompts):
        hard = math.exp(draw.gauss(0, args.sigma_prompt))
        for _ in range(args.n):
            out.append([max(1, min(args.max_tokens, round(args.median_tokens * hard * math.exp(draw.gauss(0, args.sigma_turn)))))
                        for _ in range(args.turns)])
    return out


async def trajectory(server: Any, tid: int, turns: list[int], tool_s: float, start: float, ends: list[float]) -> None:
    for k, tokens in enumerate(turns):
        await server.generate(f"t{tid}", [1], SamplingParams(), tokens)
        if k + 1 < len(turns):
            await asyncio.sleep(tool_s)
    ends[tid] = time.perf_counter() - start


async def run_mode(mode: str, work: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    engines = [SimEngine(args.max_num_seqs, args.step_ms / 1000) for _ in range(args.replicas)]
    tool_s, ends = args.tool_ms / 1000, [0.0] * len(work)
    start = time.perf_counter()
    if mode == "per-rank":
        per = math.ceil(len(work) / args.n / args.replicas) * args.n
        await asyncio.gather(*(trajectory(engines[t // per], t, turns, tool_s, start, ends)
                               for t, turns in enumerate(work)))
    elif mode == "verl":
        pool = ServerPool(engines)
        await asyncio.gather(*(trajectory(pool, t, turns, tool_s, start, ends) for t, turns in enumerate(work)))
    else:
        hands = deal(len(work), args.replicas)
        await asyncio.gather(*(trajectory(engines[r], t, work[t], tool_s, start, ends)
                               for r in range(args.replicas) for t in hands[r]))
    wall = time.perf_counter() - start
    idle = [1 - e.busy / wall for e in engines]
    ordered = sorted(ends)
    return {"mode": mode, "wall_s": wall, "p50_s": statistics.median(ordered),
            "p99_s": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
            "idle_mean": statistics.fmean(idle), "idle_max": max(idle)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, kind, default in (("replicas", int, 4), ("prompts", int, 64), ("n", int, 4), ("turns", int, 3),
                                ("max-num-seqs", int, 8), ("sigma-prompt", float, 1.0), ("sigma-turn", float, 0.5),
                                ("median-tokens", float, 64), ("max-tokens", int, 1024), ("step-ms", float, 1.0),
                                ("tool-ms", float, 20.0), ("seed", int, 0)):
        parser.add_argument(f"--{name}", type=kind, default=default)
    parser.add_argument("--seeds", type=int, default=6, help="workloads drawn (seeds `--seed` on)")
    args = parser.parse_args()
    modes = ("per-rank", "verl", "dealt")
    ratios: dict[str, list[tuple[float, float, float]]] = {m: [] for m in modes}
    print("| seed | tokens per trajectory (median, max / mean) | bound s | mode | wall s | p50 s | p99 s | "
          "idle mean | idle max | wall / per-rank | wall / bound |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for seed in range(args.seed, args.seed + args.seeds):
        work = workload(argparse.Namespace(**{**vars(args), "seed": seed}))
        lengths = sorted(sum(t) for t in work)
        bound = max(sum(lengths) / args.replicas / args.max_num_seqs, lengths[-1]) * args.step_ms / 1000
        shape = f"{lengths[len(lengths) // 2]}, {lengths[-1] / statistics.fmean(lengths):.1f}x"
        rows = [asyncio.run(run_mode(mode, work, args)) for mode in modes]
        base = rows[0]
        for r in rows:
            ratios[r["mode"]].append((r["wall_s"] / base["wall_s"], r["p99_s"] / base["p99_s"], r["idle_max"]))
            print(f"| {seed} | {shape} | {bound:.2f} | {r['mode']} | {r['wall_s']:.2f} | {r['p50_s']:.2f} | "
                  f"{r['p99_s']:.2f} | {r['idle_mean']:.2f} | {r['idle_max']:.2f} | {r['wall_s'] / base['wall_s']:.2f} | "
                  f"{r['wall_s'] / bound:.2f} |")
    print(f"\n{args.prompts} prompts x {args.n} x {args.turns} turns, {args.replicas} replicas of max_num_seqs "
          f"{args.max_num_seqs}, {args.seeds} workloads:")
    print("| mode | wall / per-rank (mean, min-max) | p99 / per-rank (mean) | idle max (mean) |")
    print("| --- | --- | --- | --- |")
    for m in modes:
        w, p, i = zip(*ratios[m], strict=True)
        print(f"| {m} | {statistics.fmean(w):.2f} ({min(w):.2f}-{max(w):.2f}) | {statistics.fmean(p):.2f} | "
              f"{statistics.fmean(i):.2f} |")


if __name__ == "__main__":
    main()
