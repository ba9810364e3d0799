"""Benchmark: bf16 mixed precision and real-token computation against the padded fp32 baseline.

    MALLOC_MMAP_THRESHOLD_=65536 python -m bench.precision step [--rows 8] [--response 256]
    python -m bench.precision learn [--steps 6] [--dir D]          # SmolLM2 GRPO, fp32 against bf16
    python -m bench.precision agree [--steps 6] [--dir D]          # SmolLM2 updates, fp32 against bf16

`step`: a Llama model shaped as SmolLM2-135M (random weights: timing and memory do not depend on
them) on a batch whose responses have mixed lengths (one row runs to `--response`, the others
stop early, as sampled responses do). Each variant runs the actor's micro-step: log-probs with
grad, the entropy for the metric, backward. `before` is the computation this trainer did before
(the padded rectangle, fp32 logits divided by the temperature, a full `log_softmax` and a softmax
entropy); the others are `trainer.models.compute_log_probs` with fp32 or bf16 (autocast, fp32
master weights) compute, padded rows cut to their longest real row or packed sequences
(`use_remove_padding`). Reported: the median seconds of `--repeats` runs and the peak resident
memory added during one (VmHWM, as `bench.memory`; run it with `MALLOC_MMAP_THRESHOLD_=65536`
so that freed tensors leave the resident set at once), and both as ratios to `before`.

`learn`: the trainer itself (`python -m trainer`'s path, in process, HF rollout, one CPU rank)
runs GRPO on `trainer.rewards.arith` with SmolLM2-135M-Instruct for `--steps` steps, once with
fp32 and once with bf16 actor and reference compute, and prints each step's mean training reward.

`agree`: the cheap form of `learn` for a loaded machine: from the same SmolLM2-135M-Instruct
weights, `--steps` AdamW updates (lr `--lr`) raising the log-probs of correct answers
(`#### <answer>`) to `trainer.rewards.arith` questions (the policy-gradient loss with advantage 1,
packed sequences), once with fp32 and once with bf16 compute (autocast, fp32 master weights);
printed: the training loss per step and the held-out questions' mean answer log-prob before and
after, for both.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.memory import _reset_peak, _status

REPO = Path(__file__).resolve().parent.parent
SMOLLM2_SHAPE = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                 "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
                 "max_position_embeddings": 2048, "tie_word_embeddings": True}


def _batch(rows: int, prompt: int, response: int) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, SMOLLM2_SHAPE["vocab_size"], (rows, prompt + response), generator=g)
    mask = torch.zeros(rows, prompt + response, dtype=torch.long)
    for r in range(rows):
        p = prompt - int(torch.randint(0, prompt // 2, (1,), generator=g))
        n = response if r == 0 else int(torch.randint(8, response // 3, (1,), generator=g))
        mask[r, prompt - p:prompt + n] = 1
    return ids, mask


def _before(model: Any, ids: Any, mask: Any, response: int) -> Any:
    """The previous computation: the padded rectangle and full-vocabulary fp32 copies."""
    import torch

    from trainer.algos.core_algos import entropy_from_logits
    from trainer.models import position_ids_from_mask

    out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask),
                use_cache=False, logits_to_keep=response + 1)
    logits = out.logits[:, -response - 1:-1, :] / 1.0
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[:, -response:, None]).squeeze(-1)
    with torch.no_grad():
        entropy_from_logits(logits.float())
    return logp


def step(args: argparse.Namespace) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer import models as M
    from trainer import parallel as P

    torch.manual_seed(0)
    fp32 = LlamaForCausalLM(LlamaConfig(**SMOLLM2_SHAPE)).train()
    bf16 = P.apply_autocast(LlamaForCausalLM(LlamaConfig(**SMOLLM2_SHAPE)).train(), torch.bfloat16)
    ids, mask = _batch(args.rows, args.prompt, args.response)
    resp_mask = mask[:, -args.response:]
    real = int(mask.sum())
    print(f"batch: {args.rows} rows x ({args.prompt} prompt + {args.response} response) columns = "
          f"{mask.numel()} padded tokens, {real} real ({real / mask.numel():.0%}); response lengths "
          f"{resp_mask.sum(1).tolist()}; torch {torch.__version__}, {torch.get_num_threads()} threads")

    def run(name: str) -> Any:
        model = bf16 if name.startswith("bf16") else fp32
        if name == "before":
            lp = _before(model, ids, mask, args.response)
        else:
            lp, _ = M.compute_log_probs(model, ids, mask, args.response, calculate_entropy=True,
                                        entropy_grad=False, remove_padding=name.endswith("packed"))
        (lp * resp_mask).sum().backward()
        model.zero_grad(set_to_none=True)

    rows = []
    for name in ("before", "fp32 cut", "fp32 packed", "bf16 cut", "bf16 packed"):
        run(name)  # warm-up
        start = _reset_peak()
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            run(name)
            times.append(time.perf_counter() - t)
        rows.append((name, statistics.median(times), _status("VmHWM") - start))
    base_s, base_b = rows[0][1], rows[0][2]
    print("| variant | step s | peak added MiB | time vs before | memory vs before |")
    print("|---|---|---|---|---|")
    for name, s, b in rows:
        print(f"| {name} | {s:.2f} | {b / 2**20:.0f} | {s / base_s:.2f} | {b / base_b:.2f} |")
    return 0


def learn(args: argparse.Namespace) -> int:
    from trainer.config import load_config
    from trainer.driver import run_training
    from trainer.metrics import read_jsonl

    root = args.dir
    model, data = root / "smollm2", root / "data"
    if not (model / "config.json").is_file():
        from trainer.models import convert_to_hf, smollm2_path

        convert_to_hf(smollm2_path(), model)
    if not (data / "test.parquet").is_file():
        subprocess.run([sys.executable, "-m", "trainer.preprocess", "arith", "--output", str(data),
                        "--train-size", "512", "--val-size", "16", "--seed", "0"], check=True, cwd=REPO)
    curves = {}
    for name in ("fp32", "bf16"):
        run = root / f"run-{name}"
        over = [
            "algorithm.adv_estimator=grpo", f"data.train_files={data / 'train.parquet'}",
            f"data.val_files={data / 'test.parquet'}", f"data.train_batch_size={args.prompts}",
            "data.max_prompt_length=128", f"data.max_response_length={args.response_length}",
            f"actor_rollout_ref.model.path={model}", f"actor_rollout_ref.actor.optim.lr={args.lr}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
            "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.001",
            "actor_rollout_ref.rollout.name=hf", f"actor_rollout_ref.rollout.n={args.n}",
            "actor_rollout_ref.model.use_remove_padding=true",
            f"actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype={name}",
            f"actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype={name}",
            "trainer.device=cpu", f"trainer.total_training_steps={args.steps}", "trainer.save_freq=-1",
            "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.logger=jsonl",
            f"trainer.default_local_dir={run}", "trainer.seed=1"]
        start = time.perf_counter()
        assert run_training(load_config(over)) == 0
        rows = read_jsonl(run / "metrics.jsonl")
        curves[name] = ([r["critic/score/mean"] for r in rows], time.perf_counter() - start)
    print("| steps | " + " | ".join(str(i + 1) for i in range(args.steps)) + " | first half | second half | wall s |")
    print("|---" * (args.steps + 4) + "|")
    for name, (scores, wall) in curves.items():
        half = len(scores) // 2
        print(f"| {name} | " + " | ".join(f"{s:.2f}" for s in scores)
              + f" | {statistics.mean(scores[:half]):.3f} | {statistics.mean(scores[half:]):.3f} | {wall:.0f} |")
    return 0


def _answers(root: Path, tokenizer: Any, rows: range) -> tuple[Any, Any, int]:
    import pyarrow.parquet as pq
    import torch

    from trainer.models import left_pad

    table = pq.read_table(root / "data" / "train.parquet").to_pylist()
    prompts, responses = [], []
    for i in rows:
        text = tokenizer.apply_chat_template(table[i]["prompt"], add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
        responses.append(tokenizer.encode(f"#### {table[i]['reward_model']['ground_truth']}",
                                          add_special_tokens=False) + [tokenizer.eos_token_id])
    p_ids, p_mask = left_pad(prompts, tokenizer.pad_token_id)
    width = max(len(r) for r in responses)
    r_ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    r_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(responses):  # right-padded responses, verl's layout
        r_ids[i, :len(r)], r_mask[i, :len(r)] = torch.tensor(r), 1
    return torch.cat([p_ids, r_ids], 1), torch.cat([p_mask, r_mask], 1), width


def agree(args: argparse.Namespace) -> int:
    import torch

    from trainer import models as M
    from trainer import parallel as P

    model_dir = args.dir / "smollm2"
    if not (model_dir / "config.json").is_file():
        M.convert_to_hf(M.smollm2_path(), model_dir)
    tokenizer = M.load_tokenizer(model_dir)
    train = _answers(args.dir, tokenizer, range(0, 16))
    held = _answers(args.dir, tokenizer, range(100, 132))

    def mean_log_prob(model: Any, batch: tuple[Any, Any, int]) -> Any:
        ids, mask, width = batch
        lp, _ = M.compute_log_probs(model, ids, mask, width, remove_padding=True)
        resp = mask[:, -width:]
        return (lp * resp).sum() / resp.sum()

    print(f"SmolLM2-135M-Instruct, {args.steps} AdamW steps at lr {args.lr} on 16 answers; held-out: 32")
    print("| compute | loss per step | held-out answer log-prob before | after | seconds |")
    print("|---|---|---|---|---|")
    for name in args.compute:
        torch.manual_seed(0)
        model = M.load_actor(model_dir).train()
        if name == "bf16":
            model = P.apply_autocast(model, torch.bfloat16)
        optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
        start = time.perf_counter()
        with torch.no_grad():
            before = float(mean_log_prob(model, held))
        losses = []
        for _ in range(args.steps):
            loss = -mean_log_prob(model, train)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            optim.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
        with torch.no_grad():
            after = float(mean_log_prob(model, held))
        print(f"| {name} | " + ", ".join(f"{x:.3f}" for x in losses)
              + f" | {before:.3f} | {after:.3f} | {time.perf_counter() - start:.0f} |", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.precision", description=__doc__.splitlines()[0])
    p.add_argument("command", choices=["step", "learn", "agree"])
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--response", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", type=Path, default=Path("/tmp/hpcrl-precision"))
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--response-length", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--compute", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"],
                   help="agree: the compute dtypes to run")
    args = p.parse_args(argv)
    return {"step": step, "learn": learn, "agree": agree}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
