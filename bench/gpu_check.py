"""The first thing to run on a GPU: the flagship's GPU-only paths, scaled to one GPU and a few minutes.

    python -m bench.gpu_check [--out DIR] [--budget 420]   # one GPU: torch >= 2.11, transformers, peft,
                                                           # hydra-core + omegaconf; no vLLM, no Ray
    python -m bench.gpu_check --dry                        # the CPU, tiny shapes (the test suite's run)

The model is Qwen2-7B's layer shapes (hidden 3584, MLP 18944, 28 query and 4 KV heads, vocabulary
152064, untied head) cut to 2 decoder layers: 1.56B parameters, of which the embedding and the head
are 1.09B. It is built as a Llama (no QKV bias: 0.01% of the parameters) with random bf16 weights
and the tiny word-level tokenizer (ids it lacks decode to nothing), so nothing is downloaded.

Sections, each timed; one that raises is reported and the next runs:
- `environment`: torch, CUDA/HIP, NCCL, the device and its memory.
- `fsdp2`: the actor worker on an NCCL group of one rank with FSDP2 (`shard_alone`), bf16 compute
  and fp32, parameter and optimizer offload on: build, two updates, a DCP save, a weight sync.
  Each phase's device peak beside the memory plan's figure for the same settings
  (:func:`trainer.memplan.plan_config`), and the host allocator's pinned bytes after the optimizer
  offload beside the bytes it holds (torch rounds each pinned block up to a power of two).
- `attention`: one forward and backward of the decoder stack (no head) over 16K and 32K tokens
  of 1K-token sequences: packed in one row (`position_ids` restarting, as `use_remove_padding`
  computes) against one row per sequence, for transformers' `sdpa`, the trainer's own packed path
  (`trainer.models.PACKED_SDPA`), flash-attn where installed and `flex_attention`; time and peak
  memory.
- `reward_model`: the colocated discriminative reward model on the device in bf16 against fp32
  on the CPU (score agreement, time per response, device peak, memory left after it sleeps).
- `trainer`: `python -m trainer`'s loop on one rank, GRPO with the HF rollout, offload on, in
  bf16: tokens/s (verl's `perf/throughput`), step time, the actor update's MFU (verl's FLOPs
  count, `perf/mfu/actor`) and each phase's peak.

- `flight_recorder`: the watchdog's flight-recorder dump from a rank on an NCCL group of one
  (:mod:`trainer.flight_recorder`): asked through the rank's pipe, its entries, their states
  (NCCL's are `completed` once their CUDA events fire), the time the dump took.
- `gpu_evidence`: this node's GPU evidence as the watchdog reads it (:mod:`hpcrl.gpu_evidence`),
  and the raw `nvidia-smi`/`amd-smi` output, to check the parsers' fixtures against.
- `gpu_oom`: one allocation past the device's memory: torch's own out-of-memory sentence, as
  the driver reads it (:mod:`trainer.workers.gpu_oom`: found, and the device size in it equal
  to the device's); on the CPU (`--dry`) the sentence the tests use.

- `pool_broadcast`: the rollout pool's weight sync (:mod:`trainer.workers.weight_broadcast`)
  between a sender and a pool rank in two processes, buckets on the device, the 2-layer state's
  3.1 GB in bf16, in turn and pipelined, checked bit for bit. On gloo with CUDA tensors: NCCL
  refuses two ranks on one GPU, so NCCL's own path needs two.

The figures print as they come and go to `OUT/gpu_check.json`. `--budget` seconds bound the whole:
a section that would start past it is skipped and named.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GIB = 1024**3
QWEN2_7B = {"hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28,
            "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 32768,
            "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
TINY = {"hidden_size": 128, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 4,
        "vocab_size": 52, "max_position_embeddings": 4096, "tie_word_embeddings": True}
PHASES = ("rollout", "weight_sync", "old_log_prob", "ref", "update_actor")


@dataclass
class Check:
    """Where the check runs and what it has found so far."""

    root: Path
    dry: bool
    budget_s: float
    start: float = field(default_factory=time.perf_counter)
    figures: dict[str, Any] = field(default_factory=dict)

    @property
    def device(self) -> str:
        return "cpu" if self.dry else "cuda"

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def section(self, name: str, fn: Callable[[Check], dict[str, Any]]) -> None:
        if self.elapsed() > self.budget_s:
            self.figures[name] = {"skipped": f"budget of {self.budget_s:.0f} s spent"}
            print(f"[{name}] skipped: budget of {self.budget_s:.0f} s spent", flush=True)
            return
        began = time.perf_counter()
        try:
            result = fn(self)
        except Exception as exc:  # a section's failure is a finding; the next section still runs
            result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
            print(result["traceback"], file=sys.stderr, flush=True)
        result["seconds"] = round(time.perf_counter() - began, 2)
        self.figures[name] = result
        print(f"[{name}] {json.dumps({k: v for k, v in result.items() if k != 'traceback'}, default=str)}",
              flush=True)


# ----------------------------------------------------------------------------- inputs


def write_model(root: Path, dry: bool) -> Path:
    """The 2-layer model (Qwen2-7B's shapes, or tiny ones with `dry`) and the tiny tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer.tiny import build_tokenizer

    out = root / ("tiny-2l" if dry else "qwen2-7b-shapes-2l")
    if (out / "config.json").is_file():
        return out
    tok = build_tokenizer()
    config = LlamaConfig(**(TINY if dry else QWEN2_7B), num_hidden_layers=2, pad_token_id=tok.pad_token_id,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    with torch.device("cpu" if dry else "cuda"):
        model = LlamaForCausalLM(config).to(torch.float32 if dry else torch.bfloat16)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    del model
    return out


def write_data(root: Path) -> Path:
    from trainer.rewards.toy import write_toy_digits

    write_toy_digits(root / "data", train_size=256, val_size=8, seed=0)
    return root / "data"


def overrides(check: Check, model: Path, precision: str, run: Path) -> list[str]:
    """GRPO on one rank with the HF rollout, offload on (verl's keys)."""
    mp = "bf16" if precision == "bf16" else "fp32"
    response = 16 if check.dry else 256
    return [
        "algorithm.adv_estimator=grpo", f"data.train_files={check.root / 'data' / 'train.parquet'}",
        f"data.val_files={check.root / 'data' / 'test.parquet'}", f"actor_rollout_ref.model.path={model}",
        "data.max_prompt_length=32", f"data.max_response_length={response}",
        f"data.train_batch_size={4 if check.dry else 16}", f"actor_rollout_ref.actor.ppo_mini_batch_size={4 if check.dry else 16}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.model.use_remove_padding=true",
        "actor_rollout_ref.actor.fsdp_config.param_offload=true",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
        "actor_rollout_ref.ref.fsdp_config.param_offload=true",
        f"actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype={mp}",
        f"actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype={mp}",
        f"actor_rollout_ref.rollout.dtype={'bfloat16' if mp == 'bf16' else 'float32'}",
        "trainer.n_gpus_per_node=1", "trainer.nnodes=1", f"trainer.device={check.device}",
        "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1",
        "trainer.logger=jsonl", f"trainer.default_local_dir={run}"]


# ----------------------------------------------------------------------------- sections


def environment(check: Check) -> dict[str, Any]:
    import torch
    import transformers

    out: dict[str, Any] = {"torch": torch.__version__, "transformers": transformers.__version__,
                           "cuda": torch.version.cuda, "hip": getattr(torch.version, "hip", None)}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out |= {"device": props.name, "memory_gib": round(props.total_memory / GIB, 1),
                "multiprocessors": props.multi_processor_count,
                "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
    return out


def _pinned() -> dict[str, int] | None:
    """The caching host allocator's figures (torch >= 2.7), or None where it has none."""
    import torch

    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None or not torch.cuda.is_available():
        return None
    s = stats()
    return {k: int(v) for k, v in s.items() if k.startswith(("allocated_bytes.current", "reserved_bytes.current",
                                                             "allocated_bytes.peak", "reserved_bytes.peak"))}


def _offloaded_bytes(optim: Any) -> int:
    import torch

    return sum(v.numel() * v.element_size() for state in optim.state.values() for v in state.values()
               if isinstance(v, torch.Tensor) and v.device.type == "cpu")


def _plan(cfg: Any, device_gib: float, precision: str) -> dict[str, float]:
    from trainer.memplan import plan_config

    made = plan_config(cfg, device_gib, layers="full", param_dtype=precision, reduce_dtype="fp32")
    return {p.name: round(p.peak / GIB, 3) for p in made.phases}


def _fsdp_one(check: Check, model: Path, precision: str, port: int) -> dict[str, Any]:
    import torch

    from bench.memory import _share
    from trainer.checkpoint import full_state as ckpt
    from trainer.config import load_config
    from trainer.workers.actor import ActorRolloutRefWorker

    # no KL term: the synthetic batches carry no reference log-probs
    seq = 64 if check.dry else 2048  # the update's rows: half prompt, half response, as the plan counts
    cfg = load_config([*overrides(check, model, precision, check.root / f"fsdp-{precision}"),
                       "actor_rollout_ref.actor.use_kl_loss=false", f"data.max_prompt_length={seq // 2}",
                       f"data.max_response_length={seq // 2}"])
    worker = ActorRolloutRefWorker(cfg, 0, 1, total_steps=10)
    out: dict[str, Any] = {}

    def phase(name: str, fn: Callable[[], Any]) -> Any:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        began = time.perf_counter()
        result = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        out[name] = {"s": round(time.perf_counter() - began, 2),
                     "peak_gib": round(torch.cuda.max_memory_allocated() / GIB, 3) if torch.cuda.is_available() else 0.0}
        return result

    pinned_before = _pinned()
    info = phase("build", lambda: worker.init_dist("127.0.0.1", port, shard_alone=True))
    out["group"] = info
    phase("update", lambda: worker.update_actor([[_share(8, seq, 1)]]))
    phase("update again", lambda: worker.update_actor([[_share(8, seq, 2)]]))
    # The optimizer offload (`to(cpu, non_blocking=True)`) allocates its host copies pinned, through
    # torch's caching host allocator; what that allocator holds beside the bytes the moments need.
    pinned_after = _pinned()
    out["optimizer_bytes_on_host"] = real = _offloaded_bytes(worker.optim)
    if pinned_before is not None and pinned_after is not None:
        key = "allocated_bytes.current"
        out["pinned_added_bytes"] = held = pinned_after.get(key, 0) - pinned_before.get(key, 0)
        out["pinned_over_real"] = round(held / max(real, 1), 3)
    tmp = check.root / f"ckpt-{precision}" / ".tmp-gpu-check"
    tmp.mkdir(parents=True, exist_ok=True)
    phase("dcp save", lambda: worker.save_checkpoint(str(tmp)))
    ckpt.commit_checkpoint(tmp.parent, 1, tmp)
    out["checkpoint_gib"] = round(sum(f.stat().st_size for f in tmp.parent.rglob("*") if f.is_file()) / GIB, 3)
    phase("weight sync", lambda: worker.sync_rollout_weights())
    device_gib = torch.cuda.get_device_properties(0).total_memory / GIB if torch.cuda.is_available() else 80.0
    try:
        out["plan_gib"] = _plan(cfg, device_gib, precision)
    except Exception as exc:  # the plan's failure is a finding of its own
        out["plan_gib"] = f"{type(exc).__name__}: {exc}"
    return out


def fsdp2(check: Check) -> dict[str, Any]:
    """The actor worker under FSDP2 on an NCCL (gloo on the CPU) group of one, bf16 then fp32."""
    from trainer.parallel import free_port

    model = write_model(check.root, check.dry)
    write_data(check.root)
    port = free_port("127.0.0.1")
    out = {}
    for precision in ("bf16", "fp32"):
        out[precision] = _fsdp_one(check, model, precision, port)
        import gc

        import torch
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def _attention_case(model: Any, tokens: int, seq: int, packed: bool, device: str) -> dict[str, Any]:
    import torch

    rows = tokens // seq
    ids = torch.randint(10, 40, (rows, seq), device=device)
    if packed:
        ids = ids.reshape(1, tokens)
        pos = torch.arange(seq, device=device).repeat(rows)[None]
    else:
        pos = torch.arange(seq, device=device).expand(rows, seq)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    began = time.perf_counter()
    hidden = model.model(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
    hidden.float().pow(2).mean().backward()
    if device == "cuda":
        torch.cuda.synchronize()
    out = {"s": round(time.perf_counter() - began, 3)}
    if device == "cuda":
        out["added_gib"] = round((torch.cuda.max_memory_allocated() - base) / GIB, 3)
    model.zero_grad(set_to_none=True)
    return out


def attention(check: Check) -> dict[str, Any]:
    """Packed against per-row attention, for each implementation this machine has."""
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM

    model_dir = write_model(check.root, check.dry)
    lengths = (128,) if check.dry else (16384, 32768)
    seq = 32 if check.dry else 1024
    from trainer.models import PACKED_SDPA, register_packed_sdpa

    register_packed_sdpa()  # as the workers' `attention_implementation` does (a section may run alone)

    impls = ["sdpa", PACKED_SDPA]  # transformers' own, and the trainer's packed path without flash-attn
    if importlib.util.find_spec("flash_attn"):
        impls.append("flash_attention_2")
    impls.append("flex_attention")
    dtype = torch.float32 if check.dry else torch.bfloat16
    out: dict[str, Any] = {}
    for impl in impls:
        try:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=impl)
            model.to(check.device)
        except Exception as exc:
            out[impl] = f"not loadable: {type(exc).__name__}: {exc}"[:300]
            continue
        for tokens in lengths:
            for packed in (False, True):
                key = f"{impl} {tokens} tokens {'packed' if packed else 'per-row'}"
                if check.elapsed() > check.budget_s:
                    out[key] = "skipped: budget spent"
                    continue
                try:
                    _attention_case(model, tokens, seq, packed, check.device)  # warm-up (kernels, compile)
                    out[key] = _attention_case(model, tokens, seq, packed, check.device)
                except Exception as exc:
                    out[key] = f"{type(exc).__name__}: {exc}"[:300]
                    if check.device == "cuda":
                        torch.cuda.empty_cache()
        del model
    return out


def trainer_steps(check: Check) -> dict[str, Any]:
    """`python -m trainer`'s loop on one rank: GRPO, HF rollout, offload on, bf16."""
    from trainer.config import load_config
    from trainer.driver import run_training
    from trainer.metrics import read_jsonl

    model = write_model(check.root, check.dry)
    write_data(check.root)
    steps = 2 if check.dry else 3
    run = check.root / "trainer-bf16"
    cfg = load_config([*overrides(check, model, "bf16", run), f"trainer.total_training_steps={steps}"])
    code = run_training(cfg)
    rows = read_jsonl(run / "metrics.jsonl")
    if code != 0 or len(rows) != steps:
        raise RuntimeError(f"the run ended with status {code} after {len(rows)} of {steps} steps; see {run}")
    timed = rows[1:] or rows

    def mean(key: str) -> float:
        return round(sum(float(r.get(key, 0.0)) for r in timed) / len(timed), 4)

    out: dict[str, Any] = {"steps": steps, "tokens/s/GPU": mean("perf/throughput"), "step_s": mean("perf/time_per_step"),
                           "mfu_actor": mean("perf/mfu/actor"), "peak_allocated_gib": mean("perf/max_memory_allocated_gb")}
    for phase in PHASES:
        key = f"perf/memory/{phase}/max_allocated_gb"
        if any(key in r for r in rows):
            out[f"{phase} GiB"] = round(max(float(r.get(key, 0.0)) for r in rows), 3)
    return out


def reward_model(check: Check) -> dict[str, Any]:
    """The colocated discriminative reward model (:class:`trainer.rewards.model.SequenceClassifierRM`)
    on the device in its default dtype (bf16 on a GPU) against the same weights in fp32 on the
    CPU: the scores' agreement, the time per response micro-batched (as the trainer scores) and one
    response per forward, the device peak while scoring, and the device memory left after it
    sleeps (it must hold none while the actor trains)."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from trainer.rewards.model import SequenceClassifierRM
    from trainer.tiny import build_tokenizer

    out = check.root / ("rm-tiny" if check.dry else "rm-qwen2-7b-shapes-2l")
    tok = build_tokenizer()
    config = LlamaConfig(**(TINY if check.dry else QWEN2_7B), num_hidden_layers=2, num_labels=1,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config).to(torch.bfloat16)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    del model
    words = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "plus", "is"]
    gen = torch.Generator().manual_seed(1)
    texts = [" ".join(words[int(i)] for i in torch.randint(0, len(words), (n,), generator=gen))
             for n in torch.randint(8, 64 if check.dry else 512, (32 if check.dry else 256,), generator=gen).tolist()]
    reference = SequenceClassifierRM(str(out), torch.device("cpu"), "fp32").score_texts(texts)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rm = SequenceClassifierRM(str(out), device, None)
    figures: dict[str, Any] = {"dtype": str(next(rm.model.parameters()).dtype),
                               "weights_gib": round(rm.weight_bytes / GIB, 3), "responses": len(texts)}
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    rm.score_texts(texts[:2], rows_per_forward=1)  # warm-up (kernels)
    got: dict[int | None, list[float]] = {}  # rows per forward: 1, or micro-batched as the trainer scores
    for key, rows in (("ms_per_response_one_per_forward", 1), ("ms_per_response", None)):
        began = time.perf_counter()
        got[rows] = rm.score_texts(texts, rows_per_forward=rows)
        if device.type == "cuda":
            torch.cuda.synchronize()
        figures[key] = round(1000 * (time.perf_counter() - began) / len(texts), 2)
    scores = got[None]
    figures["max_abs_diff_batched_vs_one_per_forward"] = round(
        max(abs(a - b) for a, b in zip(got[1], scores, strict=True)), 5)
    rm.sleep()
    if device.type == "cuda":
        figures["peak_added_gib"] = round((torch.cuda.max_memory_allocated() - before) / GIB, 3)
        figures["left_on_device_after_sleep_bytes"] = torch.cuda.memory_allocated() - before
        torch._C._cuda_clearCublasWorkspaces()  # cuBLAS's per-stream workspace, the allocator's too, not the model's
        figures["left_after_clearing_cublas_workspaces_bytes"] = torch.cuda.memory_allocated() - before
    ref, got = torch.tensor(reference), torch.tensor(scores)
    figures["max_abs_diff_vs_cpu_fp32"] = round(float((ref - got).abs().max()), 5)
    figures["score_std"] = round(float(ref.std()), 5)
    figures["correlation_vs_cpu_fp32"] = round(float(torch.corrcoef(torch.stack([ref, got]))[0, 1]), 5)
    return figures


FLIGHT_RANK = """
import os, sys, time
from pathlib import Path
from trainer import flight_recorder as FR
folder, port, backend, calls = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
os.environ.update(FR.recorder_env(folder))
import torch, torch.distributed as dist
if backend == "nccl":
    torch.cuda.set_device(0)
dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
FR.start_listener(folder, 0)
t = torch.ones(1 << 20, device="cuda" if backend == "nccl" else "cpu")
for _ in range(calls):
    dist.all_reduce(t)
if backend == "nccl":
    torch.cuda.synchronize()
else:  # gloo records a collective completed on its own thread, after the call returns: wait for it
    import pickle
    deadline = time.monotonic() + 60
    while (FR.summarise(pickle.loads(FR._recorder_bytes()[0]))["pending"] is not None
           and time.monotonic() < deadline):
        time.sleep(0.05)
print("ready", flush=True)
time.sleep(300)
"""


def flight_recorder(check: Check) -> dict[str, Any]:
    """The watchdog's flight-recorder dump (`trainer.flight_recorder`) from a rank of its own: NCCL
    (gloo on the CPU) group of one, a few all-reduces, then the dump asked for through the rank's
    pipe as the watchdog asks it. On a GPU the entries come from NCCL's recorder and each is
    `completed` (its CUDA end event fired), which the CPU's gloo recorder never says."""
    import pickle
    import subprocess

    from trainer import flight_recorder as FR
    from trainer.parallel import free_port

    folder, calls = check.root / FR.TRACE_DIR, 5
    backend = "gloo" if check.dry else "nccl"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    rank = subprocess.Popen([sys.executable, "-c", FLIGHT_RANK, str(folder), str(free_port("127.0.0.1")), backend,
                             str(calls)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert rank.stdout is not None and rank.stdout.readline() == "ready\n", "the rank did not start"
        asked = time.perf_counter()
        why = FR.request_dump(rank.pid)
        assert why is None, why
        while FR.read_note(folder, 0) is None and time.perf_counter() - asked < 120:
            time.sleep(0.1)
        took = time.perf_counter() - asked
    finally:
        rank.kill()
        rank.wait()
    note = FR.read_note(folder, 0)
    assert note is not None, "no note within 120 s"
    assert note.get("file"), note
    trace = pickle.loads(Path(note["file"]).read_bytes())
    states = sorted({str(e.get("state")) for e in trace["entries"]})
    raw = [{k: e.get(k) for k in ("collective_seq_id", "state", "retired", "time_discovered_started_ns",
                                  "time_discovered_completed_ns")} for e in trace["entries"]]
    return {"recorder": note["recorder"], "entries": note["entries"], "groups": note["groups"],
            "pg_status": trace.get("pg_status"), "raw_entries": raw,
            "pending": note["pending"], "states": states, "version": trace.get("version"),
            "names": sorted({e.get("profiling_name") for e in trace["entries"]}), "dump_s": round(took, 2),
            "bytes": Path(note["file"]).stat().st_size}


POOL_RANK = """
import datetime, json, sys, time
import torch
import torch.distributed as dist
from bench.gpu_check import pool_state, fingerprint
from trainer.workers import weight_broadcast as WB
rank, port, dry = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
device = torch.device("cpu") if dry else torch.device("cuda", 0)
state = pool_state(dry, device)
layout = WB.plan_layout(((n, t.dtype, tuple(t.shape)) for n, t in state), (1 if dry else 512) << 20, torch.bfloat16)
address = WB.BroadcastAddress("127.0.0.1", port, 2, "gloo", layout)
store = (dist.TCPStore("127.0.0.1", port, 2, True, timeout=datetime.timedelta(seconds=120), wait_for_workers=False)
         if rank == 0 else None)
pg = WB.open_group(address, rank, 120, store=store)
out = []
for version, overlap in ((1, False), (2, True), (3, True)):
    if rank == 0:
        stats = WB.Sender(pg, layout, device, overlap=overlap).send(state, version)
        out.append({"version": version, "overlap": overlap, "s": stats.seconds, "bytes": stats.bytes,
                    "wait_s": stats.wait_s, "sums": [fingerprint(t.to(torch.bfloat16)) for _, t in state]})
    else:
        began, sums = time.perf_counter(), []
        for bucket in WB.Receiver(pg, layout, device, overlap=overlap).buckets(version):
            assert all(t.device.type == device.type and t.dtype == torch.bfloat16 for _, t in bucket)
            sums += [fingerprint(t) for _, t in bucket]
        if device.type == "cuda":
            torch.cuda.synchronize()
        out.append({"version": version, "s": time.perf_counter() - began, "sums": sums})
peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
print(json.dumps({"rank": rank, "runs": out, "peak_gib": peak}), flush=True)
"""


def pool_state(dry: bool, device: Any) -> list[tuple[str, Any]]:
    """The 2-layer model's state (Qwen2-7B's shapes; tiny ones with `dry`) in fp32 on `device`,
    as the trainer's rank 0 gathers it for a sync: seeded, so the receiver can be checked."""
    import torch

    c = TINY if dry else QWEN2_7B
    h, m, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    kv = h // c["num_attention_heads"] * c["num_key_value_heads"]
    shapes = [("model.embed_tokens.weight", (v, h))]
    for i in range(2):
        shapes += [(f"model.layers.{i}.{n}", s) for n, s in (
            ("self_attn.q_proj.weight", (h, h)), ("self_attn.k_proj.weight", (kv, h)),
            ("self_attn.v_proj.weight", (kv, h)), ("self_attn.o_proj.weight", (h, h)),
            ("mlp.gate_proj.weight", (m, h)), ("mlp.up_proj.weight", (m, h)), ("mlp.down_proj.weight", (h, m)),
            ("input_layernorm.weight", (h,)), ("post_attention_layernorm.weight", (h,)))]
    shapes += [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    gen = torch.Generator(device=device).manual_seed(0)
    return [(n, torch.randn(s, generator=gen, device=device)) for n, s in shapes]


def fingerprint(t: Any) -> list[int]:
    """Exact integers of a bf16 tensor's bits: their sum and a position-weighted sum (a moved
    element changes it)."""
    import torch

    bits = t.contiguous().view(torch.int16).reshape(-1).to(torch.int64)
    weights = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64) % 1021
    return [int(bits.sum()), int((bits * weights).sum())]


def pool_broadcast(check: Check) -> dict[str, Any]:
    """The rollout pool's weight sync (:mod:`trainer.workers.weight_broadcast`) between two
    processes with their buckets on the device: a sender as actor rank 0 and one pool rank, the
    2-layer model's fp32 state sent as bf16 (3.1 GB), in turn and pipelined. NCCL refuses two
    ranks on one GPU ("Duplicate GPU detected"), so this runs on gloo with CUDA tensors: it checks
    the device buffers, the cast and the layout bit for bit on a GPU, not NCCL's speed."""
    import subprocess

    from trainer.parallel import free_port

    port = free_port("127.0.0.1")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    procs = []
    for rank in (0, 1):
        args = [sys.executable, "-c", POOL_RANK, str(rank), str(port), "1" if check.dry else "0"]
        procs.append(subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    done = [p.communicate(timeout=300) for p in procs]
    failed = [f"rank {r} exited {p.returncode}: {err[-1500:]}" for r, (p, (_, err)) in enumerate(zip(procs, done, strict=True))
              if p.returncode != 0]
    if failed:
        raise RuntimeError("; ".join(failed))
    outs = [json.loads(out.strip().splitlines()[-1]) for out, _ in done]
    sender, receiver = outs
    runs = []
    for sent, got in zip(sender["runs"], receiver["runs"], strict=True):
        runs.append({"version": sent["version"], "overlap": sent["overlap"], "gb": round(sent["bytes"] / 1e9, 3),
                     "sender_s": round(sent["s"], 3), "receiver_s": round(got["s"], 3),
                     "gb_per_s": round(sent["bytes"] / 1e9 / sent["s"], 3), "wait_s": round(sent["wait_s"], 3),
                     "bit_equal": sent["sums"] == got["sums"]})
    return {"backend": "gloo (CUDA tensors)" if not check.dry else "gloo", "runs": runs,
            "tensors": len(sender["runs"][0]["sums"]), "all_bit_equal": all(r["bit_equal"] for r in runs),
            "peak_gib": {"sender": round(sender["peak_gib"], 2), "receiver": round(receiver["peak_gib"], 2)}}


def gpu_evidence(check: Check) -> dict[str, Any]:
    """This node's GPU evidence as the watchdog reads it (`hpcrl.gpu_evidence`), with the tools'
    own output kept: the day a GPU is lent, the test fixtures' formats are checked against it."""
    from hpcrl import gpu_evidence as G

    raw = {" ".join(G.NVIDIA_SMI): G.run_command(G.NVIDIA_SMI), " ".join(G.AMD_SMI): G.run_command(G.AMD_SMI)}
    found = G.node_evidence(time.time() - 3600)
    return {"evidence": found, "raw": {k: v[1][:4000] if v else None for k, v in raw.items()}}


def gpu_oom(check: Check) -> dict[str, Any]:
    """An allocation past the device's memory, and what the driver reads of torch's sentence."""
    import torch

    from trainer.workers import gpu_oom as O

    if check.dry:  # the CPU has no device to fill: the sentence the tests use
        text = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.11 GiB of which "
                "1.02 GiB is free.")
        total = 79.11
    else:
        total = round(torch.cuda.get_device_properties(0).total_memory / GIB, 2)
        try:
            torch.empty(int((total + 1) * GIB), dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError as err:
            text = str(err)
        else:
            return {"error": f"an allocation of {total + 1:.2f} GiB did not fail"}
        torch.cuda.empty_cache()
    line = O.oom_line(text)
    return {"sentence": text[:1000], "found": line is not None, "capacity_gib": O.capacity_gib(line or ""),
            "device_gib": total}


SECTIONS: dict[str, Callable[[Check], dict[str, Any]]] = {
    "environment": environment, "fsdp2": fsdp2, "trainer": trainer_steps, "attention": attention,
    "reward_model": reward_model, "flight_recorder": flight_recorder, "gpu_evidence": gpu_evidence,
    "gpu_oom": gpu_oom, "pool_broadcast": pool_broadcast}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry", action="store_true", help="the CPU with tiny shapes (the test suite's run)")
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: a new temporary one)")
    parser.add_argument("--out", type=Path, default=None, help="where gpu_check.json goes (default: --dir)")
    parser.add_argument("--budget", type=float, default=420.0, help="seconds for all sections (420)")
    parser.add_argument("--only", nargs="*", choices=list(SECTIONS), help="run only these sections")
    args = parser.parse_args(argv)
    if not args.dry:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("gpu_check: torch sees no GPU here; `--dry` runs the same path on the CPU")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    root = args.dir or Path(tempfile.mkdtemp(prefix="hpcrl-gpu-check-"))
    root.mkdir(parents=True, exist_ok=True)
    check = Check(root, args.dry, args.budget)
    for name, fn in SECTIONS.items():
        if args.only is None or name in args.only:
            check.section(name, fn)
    out = (args.out or root) / "gpu_check.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(check.figures, indent=1, default=str))
    failed = [n for n, f in check.figures.items() if "error" in f]
    print(f"gpu_check: {len(check.figures)} sections in {check.elapsed():.0f} s, "
          f"{len(failed)} failed{': ' + ', '.join(failed) if failed else ''}; figures in {out}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
