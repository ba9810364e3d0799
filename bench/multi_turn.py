"""Do multi-turn rows line up? verl's `training/rollout_probs_diff_*` (how far vLLM's sampling
probabilities are from the actor's recomputation) on single-turn rows and on multi-turn rows.

    .venv-vllm/bin/python -m bench.multi_turn [--steps 3] [--dir D]

Two trainer runs on the tiny model with the tools tokenizer, vLLM rollout (in-process engine,
turns batched by `trainer.agent.servers.BatchedServer`), fp32, GRPO, 8 prompts x 2 samples,
responses up to 48 tokens, `rollout.calculate_log_probs=true`:

- single-turn: the toy task's rows as they are (verl's `single_turn_agent`);
- multi-turn: the same prompts through verl's `tool_agent` loop with verl's gsm8k interaction
  (a user turn after each model turn until the answer is right, up to 4 model turns).

vLLM samples each model turn from the conversation so far; the actor recomputes every token's
probability over the whole row (user turns included). If a turn's tokens were not where
generation put them, the probabilities would disagree by far more than the engines' numerical
difference. Prints each run's per-step figures and their means.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

import yaml

KEYS = ("training/rollout_probs_diff_max", "training/rollout_probs_diff_mean",
        "training/rollout_actor_probs_pearson_corr", "num_turns/mean", "response_length/mean")


def assets(root: Path) -> Path:
    from trainer.agent.interactions import GSM8K_INTERACTION_CONFIG, with_gsm8k_interaction
    from trainer.data import read_rows, write_split
    from trainer.rewards.toy import write_toy_digits
    from trainer.tiny import save_tiny

    save_tiny(root / "model", seed=0, tools=True)
    write_toy_digits(root / "toy", train_size=64, val_size=4, seed=0)
    for split in ("train", "test"):
        rows = read_rows([root / "toy" / f"{split}.parquet"])
        write_split(rows, root / "single", split)
        write_split(with_gsm8k_interaction(rows), root / "multi", split)
    (root / "interaction.yaml").write_text(yaml.safe_dump(GSM8K_INTERACTION_CONFIG))
    return root


def run(root: Path, kind: str, steps: int) -> list[dict[str, float]]:
    from trainer.config import load_config
    from trainer.driver import PPODriver
    from trainer.metrics import read_jsonl

    out = root / f"run-{kind}"
    cfg = load_config([
        f"data.train_files={root / kind / 'train.parquet'}", f"data.val_files={root / kind / 'test.parquet'}",
        "data.max_prompt_length=24", "data.max_response_length=48", f"actor_rollout_ref.model.path={root / 'model'}",
        "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.calculate_log_probs=true",
        "actor_rollout_ref.rollout.dtype=float32",
        f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={root / 'interaction.yaml'}",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=4", "actor_rollout_ref.rollout.n=2",
        "algorithm.adv_estimator=grpo", "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.optim.lr=1e-3", "trainer.val_before_train=false", "trainer.device=cpu",
        f"trainer.default_local_dir={out}", "trainer.logger=jsonl", "trainer.seed=3", "trainer.save_freq=-1",
        f"trainer.total_training_steps={steps}", "trainer.test_freq=-1"])
    assert PPODriver(cfg).fit() == 0
    return [{k: float(r[k]) for k in KEYS if k in r} for r in read_jsonl(out / "metrics.jsonl")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    root = args.dir or Path(tempfile.mkdtemp(prefix="multi-turn-"))
    assets(root)
    results = {kind: run(root, kind, args.steps) for kind in ("single", "multi")}
    for kind, rows in results.items():
        for step, row in enumerate(rows, 1):
            print(f"{kind:6} step {step}: " + json.dumps(row))
    print("| rows | " + " | ".join(k.removeprefix("training/") for k in KEYS) + " |")
    for kind, rows in results.items():
        means = [statistics.fmean(r.get(k, float("nan")) for r in rows) for k in KEYS]
        print(f"| {kind} | " + " | ".join(f"{m:.3g}" for m in means) + " |")


if __name__ == "__main__":
    main()
