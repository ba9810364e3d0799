"""Benchmark: tokens per second of a whole GRPO step, this trainer against TRL's `GRPOTrainer`.

    python -m bench.ppo_vs_trl [--prompts 8] [--n 4] [--response-length 32] [--steps 6]
                               [--warmup 1] [--rounds 3] [--ranks 1]

Both sides train the same tiny random Llama model (`trainer.tiny`) on the same toy prompts
(`trainer.rewards.toy`, verl parquet) with the same reward, batch (`--prompts` prompts x `--n`
samples), response length, sampling (temperature 1, no top-k/top-p), learning rate and
optimiser (AdamW), on the CPU in float32, without a reference model (no KL) and with one
optimiser step per batch:

- ours: `trainer.driver.PPODriver.train_step` (rollout through HF `generate`, reward, old
  log-probs, GRPO advantages, actor update);
  with `--ranks 2` the same loop on two Ray ranks of a private local cluster (its tokens per
  CPU-second and peak memory count the driver process only);
- TRL: `GRPOTrainer.train()` with `per_device_train_batch_size = prompts * n`,
  `num_generations = n`, `steps_per_generation = gradient_accumulation_steps = 1`, `beta = 0`.

A step's tokens are the non-padding prompt and response tokens (the response up to and
including its first EOS); both sides count them the same way (ours: `perf/total_num_tokens`,
TRL: its `num_tokens` log). A step's time runs from the end of the step before to its own end,
so it covers everything between steps too; a run's figure is the median over its measured steps
(the machine is shared, and other processes' bursts of load hit single steps). Each side runs in
its own fresh process so that its peak resident memory (`VmHWM`, model load and imports
included) is its own. The sides alternate for `--rounds` rounds; the median and the best round
are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULT_PREFIX = "RESULT "


@dataclass(frozen=True)
class Setup:
    """What both sides run; passed to each side's process as JSON."""

    model: str
    """Directory of the tiny model and tokenizer."""
    train_file: str
    """Toy prompts in verl's parquet format."""
    prompts: int
    """Prompts per step."""
    n: int
    """Samples per prompt (the GRPO group size)."""
    response_length: int
    """Maximum response tokens."""
    steps: int
    """Measured steps."""
    warmup: int
    """Steps run before the clock starts."""
    lr: float
    """Learning rate of both optimisers."""
    seed: int
    """Seed of both runs."""
    threads: int
    """torch intra-op threads of both sides."""
    ranks: int = 1
    """Ranks of our side (above 1: Ray worker groups)."""


@dataclass(frozen=True)
class SideResult:
    """One side's measurement, printed by its process as one JSON line."""

    side: str
    step_tokens: list[int]
    """Tokens of each measured step."""
    step_seconds: list[float]
    """Wall time of each measured step, from the end of the step before to the end of this one."""
    step_cpu_seconds: list[float]
    """CPU time of the process (all threads) over the same interval."""
    peak_rss_mib: float
    """`VmHWM` of the process at the end."""
    skipped_row_frac: float | None = None
    """Ours: mean share of rows whose zero advantages let the actor update skip them."""

    @property
    def tokens_per_s(self) -> float:
        """Median over the measured steps (robust to bursts of load from other processes)."""
        return statistics.median(t / s for t, s in zip(self.step_tokens, self.step_seconds, strict=True))

    @property
    def tokens_per_cpu_s(self) -> float:
        """Median over the measured steps of tokens per CPU-second (less sensitive to other
        processes than wall time)."""
        return statistics.median(t / s for t, s in zip(self.step_tokens, self.step_cpu_seconds, strict=True))

    @property
    def seconds_per_step(self) -> float:
        return statistics.median(self.step_seconds)

    @property
    def tokens_per_step(self) -> float:
        return statistics.mean(self.step_tokens)


def step_deltas(
    ends: list[tuple[float, float]], totals: list[float], warmup: int
) -> tuple[list[int], list[float], list[float]]:
    """Per-step tokens, wall seconds and CPU seconds after `warmup` steps, from the (wall, CPU)
    clocks at each step's end and the running token totals (one entry per step)."""
    after = range(warmup, len(ends))
    tokens = [int(totals[i] - totals[i - 1]) for i in after]
    wall = [ends[i][0] - ends[i - 1][0] for i in after]
    cpu = [ends[i][1] - ends[i - 1][1] for i in after]
    return tokens, wall, cpu


def clocks() -> tuple[float, float]:
    """(wall, process CPU) seconds."""
    return time.perf_counter(), time.process_time()


def peak_rss_mib() -> float:
    """High-water mark of this process's resident memory (`VmHWM`), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# --------------------------------------------------------------------------- ours


def run_ours(s: Setup) -> SideResult:
    from trainer.config import load_config
    from trainer.driver import PPODriver

    with tempfile.TemporaryDirectory() as run_dir:
        cfg = load_config([
            f"data.train_files={s.train_file}", f"data.val_files={s.train_file}",
            f"data.train_batch_size={s.prompts}", "data.max_prompt_length=64",
            f"data.max_response_length={s.response_length}",
            f"actor_rollout_ref.model.path={s.model}", f"actor_rollout_ref.rollout.n={s.n}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={s.prompts}",
            f"actor_rollout_ref.actor.optim.lr={s.lr}", "actor_rollout_ref.actor.optim.weight_decay=0",
            "algorithm.adv_estimator=grpo", "trainer.val_before_train=false", "trainer.device=cpu",
            f"trainer.default_local_dir={run_dir}", "trainer.logger=jsonl", f"trainer.seed={s.seed}",
            f"trainer.total_training_steps={s.warmup + s.steps}", f"trainer.n_gpus_per_node={s.ranks}",
        ])
        trainer = PPODriver(cfg)
        ends: list[tuple[float, float]] = []
        totals: list[float] = []
        skipped: list[float] = []
        for _ in range(s.warmup + s.steps):
            examples = trainer.loader.next_batch()
            trainer.state.global_step += 1
            metrics = trainer.train_step(examples)
            ends.append(clocks())
            totals.append((totals[-1] if totals else 0) + metrics["perf/total_num_tokens"])
            skipped.append(metrics["actor/skipped_row_frac"])
    return SideResult("ours", *step_deltas(ends, totals, s.warmup), peak_rss_mib(),
                      statistics.mean(skipped[s.warmup:]))


# --------------------------------------------------------------------------- TRL


def toy_reward(completions: list[Any], **_: Any) -> list[float | None]:
    """The toy task's score on the text of each completion (conversational or plain)."""
    from trainer.rewards.toy import toy_digits_score

    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [toy_digits_score(t) for t in texts]


def run_trl(s: Setup) -> SideResult:
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from trainer.data import read_rows

    class Clock(TrainerCallback):
        """Wall and CPU clocks at the end of each optimiser step, and the running token count."""

        def __init__(self) -> None:
            self.step_end: list[tuple[float, float]] = []
            self.num_tokens: list[float] = []

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.step_end.append(clocks())

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
            if logs and "num_tokens" in logs:
                self.num_tokens.append(float(logs["num_tokens"]))

    rows = read_rows([s.train_file])
    dataset = Dataset.from_list([{"prompt": r["prompt"]} for r in rows])
    tokenizer = AutoTokenizer.from_pretrained(s.model)
    clock = Clock()
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out, per_device_train_batch_size=s.prompts * s.n, num_generations=s.n,
            gradient_accumulation_steps=1, steps_per_generation=1, max_completion_length=s.response_length,
            temperature=1.0, top_p=1.0, top_k=0, beta=0.0, learning_rate=s.lr, weight_decay=0.0,
            max_steps=s.warmup + s.steps, use_cpu=True, bf16=False, fp16=False,
            gradient_checkpointing=False, logging_steps=1, report_to="none", save_strategy="no",
            disable_tqdm=True, seed=s.seed, dataloader_num_workers=0,
        )
        trainer = GRPOTrainer(model=s.model, reward_funcs=toy_reward, args=args, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[clock])
        trainer.train()
    if len(clock.num_tokens) != len(clock.step_end):
        raise RuntimeError(f"TRL logged {len(clock.num_tokens)} token counts for {len(clock.step_end)} steps")
    return SideResult("trl", *step_deltas(clock.step_end, clock.num_tokens, s.warmup), peak_rss_mib())


# --------------------------------------------------------------------------- driver


def run_side(side: str, setup: Setup) -> SideResult:
    """Run one side in a fresh process and read back its result line."""
    path = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "PYTHONPATH": path, "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": str(setup.threads), "MKL_NUM_THREADS": str(setup.threads)}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.ppo_vs_trl", "--side", side, "--setup", json.dumps(asdict(setup))],
        env=env, cwd=REPO, capture_output=True, text=True, check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"the `{side}` side failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return SideResult(**json.loads(lines[-1][len(RESULT_PREFIX):]))


def make_inputs(root: Path, seed: int) -> tuple[Path, Path]:
    from trainer.rewards.toy import write_toy_digits
    from trainer.tiny import save_tiny

    model = save_tiny(root / "model", seed=seed)
    data = write_toy_digits(root / "data", train_size=512, val_size=8, seed=seed)
    return model, data["train"]


def report(setup: Setup, results: dict[str, list[SideResult]]) -> None:
    print(f"tiny model, {setup.prompts} prompts x n={setup.n}, response <= {setup.response_length} tokens, "
          f"{setup.threads} thread(s), ours on {setup.ranks} rank(s), {setup.steps} measured steps after {setup.warmup} warm-up, "
          f"{len(results['ours'])} round(s)")
    print(f"{'side':6} {'tokens/s':>9} {'tokens/CPU-s':>12} {'s/step':>7} {'tokens/step':>11} {'peak RSS MiB':>12}"
          "  (medians over steps)")
    for side, rs in results.items():
        for r in rs:
            print(f"{side:6} {r.tokens_per_s:9.1f} {r.tokens_per_cpu_s:12.1f} {r.seconds_per_step:7.3f} "
                  f"{r.tokens_per_step:11.1f} {r.peak_rss_mib:12.0f}")

    def med(metric: str) -> dict[str, float]:
        return {side: statistics.median(getattr(r, metric) for r in rs) for side, rs in results.items()}

    for label, metric in (("tokens/s (wall)", "tokens_per_s"), ("tokens/CPU-s", "tokens_per_cpu_s")):
        m = med(metric)
        print(f"{label:16} median of rounds: ours {m['ours']:8.1f}, TRL {m['trl']:8.1f}; "
              f"ratio ours/TRL = {m['ours'] / m['trl']:.2f}x (goal >= 1.5x)")
    skipped = statistics.mean(r.skipped_row_frac or 0.0 for r in results["ours"])
    print(f"ours skipped the actor update of {skipped:.0%} of rows (zero advantage: groups that scored alike)")
    peak = med("peak_rss_mib")
    print(f"{'peak RSS (VmHWM)':16} median of rounds: ours {peak['ours']:6.0f} MiB, TRL {peak['trl']:6.0f} MiB "
          f"(ratio {peak['ours'] / peak['trl']:.2f}x)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt (group size)")
    parser.add_argument("--response-length", type=int, default=32, help="maximum response tokens")
    parser.add_argument("--steps", type=int, default=6, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=1, help="steps before the clock starts")
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs of each side")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of each side (1: other processes' load does not stall "
                        "a thread barrier, and CPU time measures the work)")
    parser.add_argument("--ranks", type=int, default=1,
                        help="ranks of our side (above 1: Ray worker groups on a private local cluster)")
    parser.add_argument("--side", choices=("ours", "trl"), help=argparse.SUPPRESS)
    parser.add_argument("--setup", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.side:
        setup = Setup(**json.loads(args.setup))
        import torch

        torch.set_num_threads(setup.threads)
        result = run_ours(setup) if args.side == "ours" else run_trl(setup)
        print(RESULT_PREFIX + json.dumps(asdict(result)), flush=True)
        return 0
    if args.warmup < 1:
        parser.error(f"`--warmup` must be >= 1 (received {args.warmup}): the first step pays one-off costs")
    with tempfile.TemporaryDirectory() as tmp:
        model, train = make_inputs(Path(tmp), args.seed)
        setup = Setup(str(model), str(train), args.prompts, args.n, args.response_length, args.steps,
                      args.warmup, args.lr, args.seed, args.threads, args.ranks)
        results: dict[str, list[SideResult]] = {"ours": [], "trl": []}
        for _ in range(args.rounds):
            for side in ("ours", "trl"):
                results[side].append(run_side(side, setup))
    report(setup, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
