"""Agent-loop generation: turn-synchronous batches on the in-process vLLM engine against
server-mode vLLM replicas behind the server pool, on heavy-tailed response lengths.

    .venv-vllm/bin/python -m bench.agent_rollout [--trajectories 32] [--turns 3] [--replicas 1 2]
        [--median-tokens 24] [--sigma 1.0] [--max-tokens 192] [--tool-ms 5] [--hidden 512] [--layers 4]

Each trajectory asks for `--turns` turns; each turn's `max_tokens` is drawn from a lognormal
(median `--median-tokens`, shape `--sigma`, cut to `--max-tokens`), and the model, random weights
that rarely sample EOS, mostly uses all of it: a few long turns among many short ones, as agent
rollouts have. Between turns a trajectory waits `--tool-ms` (a tool call). The same workload
(same draws) runs on:

- `batched`: :class:`trainer.agent.servers.BatchedServer` over one
  :class:`trainer.rollout.vllm.VLLMRolloutEngine`: a batch goes out once every live trajectory
  waits, so each turn waits for the longest turn of its batch;
- `server xK`: K :class:`trainer.rollout.vllm_server.VLLMServer` replicas behind
  :class:`trainer.agent.servers.ServerPool`: each turn is served as it comes.

Figures: the wall time of the whole rollout, generated tokens per second, p50/p99 latency of a
turn (call to answer), and the idle fraction (the share of the wall time an engine had no work:
outside `generate_tokens` for `batched`, no request in flight on a replica for `server`, the mean
over replicas), each mode also as a ratio to `batched` of the same run. The model is the tiny
Llama of :mod:`trainer.tiny` widened by `--hidden`/`--layers` (vLLM's CPU backend here)."""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MAX_MODEL_LEN = 1024


@dataclass
class Tally:
    """Latencies, tokens, and the busy time of each engine."""

    latencies: list[float] = field(default_factory=list)
    tokens: int = 0
    busy: dict[int, float] = field(default_factory=dict)
    running: dict[int, int] = field(default_factory=dict)
    since: dict[int, float] = field(default_factory=dict)

    def start(self, engine: int) -> None:
        if not self.running.get(engine):
            self.since[engine] = time.perf_counter()
        self.running[engine] = self.running.get(engine, 0) + 1

    def stop(self, engine: int) -> None:
        self.running[engine] -= 1
        if not self.running[engine]:
            self.busy[engine] = self.busy.get(engine, 0.0) + time.perf_counter() - self.since[engine]


class TimedEngine:
    """The batched engine, its `generate_tokens` time tallied."""

    def __init__(self, engine: Any, tally: Tally) -> None:
        self.engine, self.tally = engine, tally

    def generate_tokens(self, prompts, params, max_tokens):
        self.tally.start(0)
        try:
            return self.engine.generate_tokens(prompts, params, max_tokens)
        finally:
            self.tally.stop(0)


class TimedServer:
    """A replica, the time it has requests in flight tallied."""

    def __init__(self, server: Any, index: int, tally: Tally) -> None:
        self.server, self.index, self.tally = server, index, tally

    async def generate(self, request_id, prompt_ids, params, max_tokens):
        self.tally.start(self.index)
        try:
            return await self.server.generate(request_id, prompt_ids, params, max_tokens)
        finally:
            self.tally.stop(self.index)


def workload(args: argparse.Namespace) -> tuple[list[list[int]], list[list[int]]]:
    """Per trajectory: a prompt and the `max_tokens` of each turn (lognormal, heavy-tailed)."""
    rng = random.Random(args.seed)
    prompts = [[5] + [rng.randrange(17, 40) for _ in range(rng.randrange(8, 33))] for _ in range(args.trajectories)]
    mu = math.log(args.median_tokens)
    limits = [[max(1, min(args.max_tokens, round(rng.lognormvariate(mu, args.sigma)))) for _ in range(args.turns)]
              for _ in range(args.trajectories)]
    return prompts, limits


async def rollout(server: Any, prompts: list[list[int]], limits: list[list[int]], tool_s: float,
                  tally: Tally, batched: Any = None) -> None:
    """Every trajectory concurrently: turn, tool wait, next turn (the turn's answer and a tool
    token appended to the context)."""
    from trainer.rollout.base import SamplingParams

    greedy = SamplingParams(do_sample=False)

    async def trajectory(i: int) -> None:
        context = list(prompts[i])
        try:
            for turn, limit in enumerate(limits[i]):
                start = time.perf_counter()
                out = await server.generate(f"t{i}", context, greedy, limit)
                tally.latencies.append(time.perf_counter() - start)
                tally.tokens += len(out.token_ids)
                context += out.token_ids
                if turn + 1 < len(limits[i]):
                    await asyncio.sleep(tool_s)
                    context.append(6)
        finally:
            if batched is not None:
                batched.close()

    if batched is not None:
        for _ in prompts:
            batched.open()
    await asyncio.gather(*(trajectory(i) for i in range(len(prompts))))


def figures(name: str, wall: float, tally: Tally, engines: int) -> dict[str, Any]:
    lat = sorted(tally.latencies)
    idle = statistics.mean(1.0 - tally.busy.get(e, 0.0) / wall for e in range(engines))
    return {"mode": name, "wall_s": wall, "tokens_per_s": tally.tokens / wall, "tokens": tally.tokens,
            "p50_s": lat[len(lat) // 2], "p99_s": lat[min(len(lat) - 1, round(0.99 * (len(lat) - 1)))],
            "idle": idle}


def run_batched(model: Path, args: argparse.Namespace, prompts, limits) -> dict[str, Any]:
    from trainer.agent.servers import BatchedServer
    from trainer.rollout.base import SamplingParams
    from trainer.rollout.vllm import VLLMRolloutEngine

    engine = VLLMRolloutEngine(model, pad_token_id=0, eos_token_ids=[3], max_model_len=MAX_MODEL_LEN, seed=0)
    try:
        engine.generate_tokens([prompts[0]], SamplingParams(), [4])  # warm-up
        tally = Tally()
        server = BatchedServer(TimedEngine(engine, tally))
        start = time.perf_counter()
        asyncio.run(rollout(server, prompts, limits, args.tool_ms / 1000, tally, batched=server))
        out = figures("batched", time.perf_counter() - start, tally, 1)
        out["batches"] = len(server.stats.batch_sizes)
        return out
    finally:
        engine.close()


def run_servers(model: Path, k: int, args: argparse.Namespace, prompts, limits) -> dict[str, Any]:
    from trainer.agent.servers import ServerPool
    from trainer.rollout.base import SamplingParams
    from trainer.rollout.vllm_server import VLLMServer

    replicas = [VLLMServer(model, eos_token_ids=[3], max_model_len=MAX_MODEL_LEN, seed=0) for _ in range(k)]

    async def main() -> dict[str, Any]:
        await asyncio.gather(*(r.generate("warm", prompts[0], SamplingParams(), 4) for r in replicas))
        tally = Tally()
        pool = ServerPool([TimedServer(r, i, tally) for i, r in enumerate(replicas)])
        start = time.perf_counter()
        await rollout(pool, prompts, limits, args.tool_ms / 1000, tally)
        return figures(f"server x{k}", time.perf_counter() - start, tally, k)

    try:
        return asyncio.run(main())
    finally:
        for r in replicas:
            r.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=32)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--median-tokens", type=float, default=24)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--tool-ms", type=float, default=5.0)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from trainer.tiny import save_tiny

    prompts, limits = workload(args)
    drawn = sorted(m for row in limits for m in row)
    print(f"{args.trajectories} trajectories x {args.turns} turns; max_tokens median {drawn[len(drawn) // 2]}, "
          f"p90 {drawn[int(0.9 * (len(drawn) - 1))]}, max {drawn[-1]}, sum {sum(drawn)}")
    with tempfile.TemporaryDirectory() as tmp:
        model = save_tiny(Path(tmp) / "model", hidden_size=args.hidden, num_hidden_layers=args.layers,
                          intermediate_size=3 * args.hidden, max_position_embeddings=MAX_MODEL_LEN)
        rows = [run_batched(model, args, prompts, limits)]
        rows += [run_servers(model, k, args, prompts, limits) for k in args.replicas]
    base = rows[0]
    print("| mode | wall s | tokens/s | p50 s | p99 s | idle | wall / batched | tokens/s / batched | "
          "p50 / batched | p99 / batched |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['mode']} | {r['wall_s']:.2f} | {r['tokens_per_s']:.0f} | {r['p50_s']:.3f} | {r['p99_s']:.3f} "
              f"| {r['idle']:.2f} | {r['wall_s'] / base['wall_s']:.2f} | "
              f"{r['tokens_per_s'] / base['tokens_per_s']:.2f} | {r['p50_s'] / base['p50_s']:.2f} | "
              f"{r['p99_s'] / base['p99_s']:.2f} |")
    print(f"batched: {base['batches']} batches; tokens generated per mode: {[r['tokens'] for r in rows]}")


if __name__ == "__main__":
    main()
