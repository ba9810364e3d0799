"""Peak memory per rank of the actor worker on W = 1, 2, 4 CPU ranks (gloo), phase by phase.

    python -m bench.memory [--ranks 1 2 4] [--rollout-tp 1 2] [--baseline-tree /tmp/mem-base]
    python -m bench.memory --build-only --baseline-tree /tmp/mem-base   # host memory at build, per node

A random Llama-shaped model (hidden 768, 16 layers, MLP 2560, GQA 12/4 heads, vocab 32000, tied
embeddings: about 150M parameters, 0.6 GB in float32) is written once; then, for every tree
(this one, and with ``--baseline-tree`` another checkout of hpcrl, e.g. ``git worktree add
/tmp/mem-base d090bdd``) and every W, W plain processes (``torch.multiprocessing``, one gloo group)
each build the tree's own ``ActorRolloutRefWorker`` and run, in order:

- ``build``: load the model, shard it (or not, as that tree does), AdamW, the rollout engine;
- ``step``: one actor update (2 rows of 64 tokens per rank, one optimizer step);
- ``step again``: a second update, the steady state (the Adam moments exist from the start, the
  parameters are resident);
- ``save``: the checkpoint (sharded DCP state + the ``huggingface/`` export);
- ``load``: loading that checkpoint back;
- ``sync``: the weight sync to the rollout engine (the first one also brings the engine's own
  weights into memory: transformers maps the model file, so its pages become resident only when
  written);
- ``sync again``: a second sync, whose added memory is the sync's own transient (the buckets).

What is measured, per rank: ``state`` = bytes of this rank's parameters and Adam moments as it
holds them after the step (local shards under FSDP2; the gradients are freed by the optimizer
step, ``zero_grad(set_to_none=True)``, and show up only in the step's peak); for each phase, the
peak resident set (``VmHWM`` from ``/proc/self/status``, reset to the current RSS by writing ``5``
to ``/proc/self/clear_refs`` just before the phase) and that peak minus the RSS at the phase's
start (what the phase added, transiently or not). RSS counts everything the process maps:
Python, torch, the tokenizer, the rollout engine's own weights. Every rank sets
``MALLOC_MMAP_THRESHOLD_=65536``, so freed tensors go back to the system at once (glibc's
dynamic threshold would otherwise keep them in the heap and carry them into the next phase's
start), and ``OMP_NUM_THREADS=1``. The table shows the largest figure over the ranks. Beside the second step, ``est. +MiB`` is the memory plan's estimate of what a steady-state step
adds (:func:`trainer.memplan.update_estimate`: torch's FSDP2 memory tracker under
``FakeTensorMode`` on this model's config, W fake ranks, the same 2 x 64-token micro-batch; its
peak less the parameter shards and Adam moments the rank holds before the step) and
``est./meas.`` its ratio to the measured ``+added``.
With ``--rollout-tp``, every W runs once per
rollout tensor-parallel size k dividing it (``actor_rollout_ref.rollout.tensor_model_parallel_size``;
the HF engine's copy split over k ranks), and ``rollout/rank`` is the bytes of that copy one rank
holds.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PHASES = ("build", "step", "step again", "save", "load", "sync", "sync again")
MODEL_SHAPE = {"hidden_size": 768, "num_hidden_layers": 16, "intermediate_size": 2560,
               "num_attention_heads": 12, "num_key_value_heads": 4, "vocab_size": 32000,
               "max_position_embeddings": 512, "tie_word_embeddings": True}
MIB = 2**20


# ----------------------------------------------------------------------------- in each rank


def _status(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> int:
    """Collect garbage, reset VmHWM to the current RSS, return that RSS."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    return _status("VmRSS")


def _local_bytes(worker: Any) -> int:
    """Parameters, gradients and optimizer moments as this rank holds them."""
    import torch

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    total = 0
    for p in worker.model.parameters():
        total += local(p).numel() * local(p).element_size()
        if p.grad is not None:
            total += local(p.grad).numel() * local(p.grad).element_size()
    for state in worker.optim.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                total += local(value).numel() * local(value).element_size()
    return total


def _share(rows: int, length: int, seed: int) -> Any:
    import torch

    from trainer.batch import MiniBatchShare, StepBatch

    g = torch.Generator().manual_seed(seed)
    prompt = length // 2
    ids = torch.randint(5, 40, (rows, length), generator=g)
    mask = torch.ones(rows, length, dtype=torch.long)
    response_mask = torch.ones(rows, length - prompt)
    adv = torch.randn(rows, length - prompt, generator=g)
    batch = StepBatch(examples=[], uids=[], input_ids=ids, attention_mask=mask, response_mask=response_mask,
                      old_log_probs=-torch.rand(rows, length - prompt, generator=g), advantages=adv)
    return MiniBatchShare(batch, float(response_mask.sum()) * 1.0, float(rows))


def _barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


def _rollout_bytes(worker: Any) -> int:
    """Bytes of the rollout engine's weights this rank holds (its shards when split)."""
    model = getattr(worker.rollout, "model", None)
    if model is None:
        return 0
    params = (p.to_local() if hasattr(p, "to_local") else p for p in model.parameters())
    return sum(t.numel() * t.element_size() for t in params)


def _rank_main(rank: int, world: int, port: int, model: str, out: str, tp: int = 1, build_only: bool = False,
               param_dtype: str = "fp32") -> None:
    import torch

    from trainer.checkpoint import full_state as ckpt
    from trainer.config import load_config
    from trainer.workers.actor import ActorRolloutRefWorker

    figures: dict[str, Any] = {}

    def phase(name: str, fn: Any) -> Any:
        start = _reset_peak()
        result = fn()
        gc.collect()
        figures[name] = {"start": start, "peak": _status("VmHWM"), "end": _status("VmRSS")}
        return result

    cfg = load_config([f"actor_rollout_ref.model.path={model}", f"trainer.n_gpus_per_node={world}",
                       "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                       "data.max_response_length=32", "data.max_prompt_length=32",
                       f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}",
                       f"actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype={param_dtype}"])
    worker = ActorRolloutRefWorker(cfg, rank, world, total_steps=10)
    phase("build", lambda: worker.init_dist("127.0.0.1" if world > 1 else None, port if world > 1 else None))
    if build_only:
        figures["torch"] = torch.__version__
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(figures))
        return
    phase("step", lambda: worker.update_actor([[_share(2, 64, rank)]]))
    phase("step again", lambda: worker.update_actor([[_share(2, 64, rank + 100)]]))
    figures["state_bytes"] = _local_bytes(worker)
    root = Path(out) / "ckpt"
    tmp = root / ".tmp-bench"
    if rank == 0:
        tmp.mkdir(parents=True, exist_ok=True)
    _barrier(world)
    phase("save", lambda: worker.save_checkpoint(str(tmp)))
    _barrier(world)
    if rank == 0:
        ckpt.commit_checkpoint(root, 1, tmp)
    _barrier(world)
    phase("load", lambda: worker.load_checkpoint(str(root / "global_step_1")))
    phase("sync", lambda: worker.sync_rollout_weights())
    phase("sync again", lambda: worker.sync_rollout_weights())
    figures["params"] = sum(p.numel() for p in worker.model.parameters())
    figures["rollout_bytes"] = _rollout_bytes(worker)
    figures["torch"] = torch.__version__
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(figures))


def _child(world: int, port: int, model: str, out: str, tp: int, build_only: bool, param_dtype: str) -> None:
    """Run W ranks of this tree (the one on PYTHONPATH) and wait for them."""
    import torch.multiprocessing as mp

    mp.spawn(_rank_main, args=(world, port, model, out, tp, build_only, param_dtype), nprocs=world)


# ----------------------------------------------------------------------------- the driver


def write_model(directory: Path, dtype: str = "float32") -> Path:
    """The random ~150M-parameter Llama-shaped model (saved in `dtype`) and the tiny word-level
    tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer.tiny import build_tokenizer

    tok = build_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(**MODEL_SHAPE, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                         bos_token_id=tok.bos_token_id)
    LlamaForCausalLM(config).to(getattr(torch, dtype)).save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(tree: Path, world: int, model: Path, work: Path, tp: int = 1, build_only: bool = False,
            param_dtype: str = "fp32") -> list[dict[str, Any]]:
    out = work / f"{tree.name}-{world}-tp{tp}"
    out.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536",
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(world), str(_free_port()), str(model),
           str(out), str(tp), "build" if build_only else "all", param_dtype]
    subprocess.run(cmd, env=env, cwd=tree, check=True)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    shutil.rmtree(out / "ckpt", ignore_errors=True)
    return ranks


def step_estimate(world: int, param_dtype: str = "fp32") -> int:
    """The memory plan's bytes added by the step on one of `world` ranks (see the docstring)."""
    from trainer.memplan import update_estimate

    peak = update_estimate({"model_type": "llama", **MODEL_SHAPE}, world, 2, 64, 32, param_dtype=param_dtype)
    # held before the step: the fp32 shards, their two AdamW moments and the buffers (the step's own
    # optimizer temporaries, which the tracer files under OPT too, count as added)
    held = 3 * peak.get("SHARDED_PARAM", 0) + peak.get("BUFFER", 0)
    return peak["Total"] - held


def mib(value: float) -> str:
    return f"{value / MIB:,.0f}"


def build_row(label: str, world: int, ranks: list[dict[str, Any]]) -> str:
    """The build's host memory: the largest rank's peak, and the node's (all W ranks on one
    node: the sum of their peaks, an upper bound of the node's peak)."""
    peaks = [r["build"]["peak"] for r in ranks]
    added = [r["build"]["peak"] - r["build"]["start"] for r in ranks]
    return f"| {label} | {world} | {mib(max(peaks))} | {mib(sum(peaks))} | {mib(sum(added))} |"


BUILD_HEADER = ("| tree | W | build peak/rank MiB | build peak/node MiB (sum of ranks) | added by the build/node MiB |\n"
                "|---|---|---|---|---|")


def added_by(ranks: list[dict[str, Any]], phase: str) -> int:
    """What `phase` added to the largest rank: its peak less the resident set at its start."""
    return max(r[phase]["peak"] - r[phase]["start"] for r in ranks)


def row(label: str, world: int, ranks: list[dict[str, Any]], tp: int = 1, estimate: int | None = None) -> str:
    cells = [label, str(world), str(tp), mib(max(r["state_bytes"] for r in ranks)),
             mib(max(r.get("rollout_bytes", 0) for r in ranks))]
    for name in PHASES:
        peak = max(r[name]["peak"] for r in ranks)
        added = added_by(ranks, name)
        cells.append(f"{mib(peak)} (+{mib(added)})")
        if name == "step again" and estimate is not None:
            cells += [f"+{mib(estimate)}", f"{estimate / added:.2f}"]
    return "| " + " | ".join(cells) + " |"


_COLUMNS = [f"{p} peak (+added) MiB" for p in PHASES]
_COLUMNS[3:3] = ["est. +MiB", "est./meas."]
HEADER = ("| tree | W | rollout TP | state/rank MiB | rollout/rank MiB | " + " | ".join(_COLUMNS) + " |\n"
          "|---|---|---|---|---|" + "---|" * len(_COLUMNS))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rollout-tp", type=int, nargs="+", default=[1],
                        help="rollout tensor-parallel sizes; each W runs with every k dividing it")
    parser.add_argument("--baseline-tree", type=Path, default=None,
                        help="another checkout of hpcrl to measure the same way (e.g. the tree before a change)")
    parser.add_argument("--work", type=Path, default=None, help="scratch directory (default: a temporary one)")
    parser.add_argument("--param-dtype", choices=["fp32", "bf16"], default="fp32",
                        help="the actor's compute precision (`fsdp_config.mixed_precision.param_dtype`), "
                             "measured and planned")
    parser.add_argument("--build-only", action="store_true",
                        help="measure the build alone: host memory per rank and per node (all W ranks on one node)")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="hpcrl-mem-", dir=args.work))
    try:
        # the build alone: a bfloat16 checkpoint, as hub models ship, which the fp32 actor converts
        model = write_model(work / "model", "bfloat16" if args.build_only else "float32")
        trees = [("this tree", REPO)] + ([("baseline", args.baseline_tree.resolve())] if args.baseline_tree else [])
        lines = [BUILD_HEADER if args.build_only else HEADER]
        estimates: dict[int, int] = {}
        for label, tree in trees:
            for world in args.ranks:
                for tp in [1] if args.build_only else [k for k in args.rollout_tp if world % k == 0]:
                    ranks = measure(tree, world, model, work / "runs", tp, args.build_only, args.param_dtype)
                    if args.build_only:
                        lines.append(build_row(label, world, ranks))
                    else:
                        estimates.setdefault(world, step_estimate(world, args.param_dtype))
                        lines.append(row(label, world, ranks, tp, estimates[world]))
                    print(lines[-1], flush=True)
        if not args.build_only:
            print(f"\nmodel: {ranks[0]['params'] / 1e6:.0f}M parameters as the worker counts them (float32)")
        print(f"torch {ranks[0]['torch']}\n")
        print("\n".join(lines))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5],
               int(sys.argv[6]) if len(sys.argv) > 6 else 1, len(sys.argv) > 7 and sys.argv[7] == "build",
               sys.argv[8] if len(sys.argv) > 8 else "fp32")
    else:
        sys.exit(main())
