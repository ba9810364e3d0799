"""A per-device memory plan of a configuration, from the model's `config.json` alone (no
weights): the peak of each phase (rollout, actor update, critic update, weight sync) and a
refusal naming the phase, its largest term and the fix when one cannot fit.

- Actor and critic update: :mod:`trainer.memtrace` (torch's FSDP2 memory tracker under
  `FakeTensorMode`) on the planned micro-batch, in its own process. A model deeper than three
  layers is traced with 2 and 3 layers and the per-layer terms extrapolated linearly (every
  decoder layer is the same); `layers="full"` traces the whole model.
- Rollout: vLLM's accounting. vLLM takes `gpu_memory_utilization` x the device's TOTAL memory
  for its weights, activations and KV cache, and refuses to start when less than that is free:
  on top of what the trainer holds when vLLM wakes (sharded parameters, optimizer moments, the
  reference and critic shards, unless offloaded). Its KV cache must hold one
  `max_model_len` sequence.
- Weight sync: the trainer's resident state, vLLM's weights, and one bucket of
  `update_weights_bucket_megabytes` gathered parameters (or the largest parameter, if larger).
- Host memory of one node (:func:`host_phase`, against the job's `slurm.mem`): per GPU worker a
  process baseline, the offloaded parameter shards (pageable: `model.to("cpu")` is blocking),
  the offloaded AdamW moments and, were vLLM to sleep at level 1, its weight backup. The last two
  are pinned: `to("cpu", non_blocking=True)` from a GPU and vLLM's `pin_memory=True` backup
  allocate through torch's caching host allocator, which rounds every block up to the next power
  of two (`CachingHostAllocator.h`: `c10::llvm::PowerOf2Ceil(size)`, under the default
  `pinned_max_round_threshold`, unbounded) and keeps it cached for reuse, so each tensor counts
  at its rounded size.

Precision: the plan is for a GPU, so it takes the dtypes the trainer uses there: the actor's
`fsdp_config.mixed_precision.param_dtype` / `reduce_dtype` (FSDP2's `MixedPrecisionPolicy`;
null = bf16, verl's GPU default) over fp32 master weights (`model_dtype`), and
`rollout.dtype` (null = bf16) for vLLM's weights. The critic is planned with its own model's
`config.json` under `critic.model.override_config`, as it is built, in the actor's precision,
and one rank is traced without the autocast the trainer applies there (fp32 activations: an
over-estimate).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from trainer.config.reward import RM_TOKENS_PER_FORWARD
from trainer.hf_overrides import apply_updates, override_kwargs
from trainer.memplan_inputs import (
    GIB,
    ModelShape,
    PlanError,
    Settings,
    TrainSide,
    plan_dtype,
    read_model,
    settings_from_config,
)
from trainer.rollout.vllm import max_model_len

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
CUDA_CONTEXT = 1 * GIB
"""Per-process CUDA/ROCm context and allocator slack, counted once for the trainer."""
HOST_PROCESS = 3 * GIB
"""Host memory of one GPU worker process before any model state: the interpreter with torch,
transformers, Ray's worker and vLLM imported (measured on the CPU: bench/host_memory.py) plus the
CUDA/ROCm runtime's host side (its libraries' pages and the context's host allocations)."""
HOST_DRIVER = 2 * GIB
"""The driver process on the head node (the loop, the dataset, Ray's client)."""
CUDA_GRAPHS = 2 * GIB
"""vLLM's CUDA graphs (`enforce_eager=false`), per device. Since vLLM 0.21 its worker measures
them at start and takes them out of the KV cache's room inside `gpu_memory_utilization`
(`VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1`, `vllm/v1/worker/gpu_worker.py`,
`determine_available_memory`), so they lower the KV cache, not the share. Not measured here (no
GPU with vLLM): an upper figure from vLLM's own logs, "Estimated CUDA graph memory" 0.36 GiB
(16 sizes) to 1.62 GiB (51 piecewise sizes up to 512 and 35 full ones, the default capture)."""


# ----------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Phase:
    name: str
    terms: tuple[tuple[str, int], ...]
    fix: str
    limit: int = 0  # bytes this phase may use (the device's, unless a share of it)
    note: str = ""
    unit: str = "per device"

    @property
    def peak(self) -> int:
        return sum(b for _, b in self.terms)

    @property
    def largest(self) -> tuple[str, int]:
        return max(self.terms, key=lambda t: t[1])

    @property
    def fits(self) -> bool:
        return self.peak <= self.limit


@dataclass(frozen=True)
class Plan:
    model: str
    params: int
    device_bytes: int
    phases: tuple[Phase, ...]
    notes: tuple[str, ...]

    @property
    def fits(self) -> bool:
        return all(p.fits for p in self.phases)

    def table(self) -> str:
        lines = [f"memory plan: {self.model}, {self.params / 1e9:.2f}B parameters, "
                 f"{self.device_bytes / GIB:.0f} GiB per device",
                 f"{'phase':<16} {'peak GiB':>9} {'limit GiB':>9}  largest term"]
        for p in self.phases:
            name, size = p.largest
            mark = "" if p.fits else "  DOES NOT FIT"
            lines.append(f"{p.name:<16} {p.peak / GIB:>9.1f} {p.limit / GIB:>9.1f}  {name} "
                         f"{size / GIB:.1f} GiB{mark}")
            lines.append("    " + ", ".join(f"{n} {b / GIB:.2f}" for n, b in p.terms if b))
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def refusal(self) -> str | None:
        """The refusal of the first phase that cannot fit, or None."""
        for p in self.phases:
            if not p.fits:
                name, size = p.largest
                return (f"the {p.name} phase needs {p.peak / GIB:.1f} GiB {p.unit} but "
                        f"{p.limit / GIB:.1f} GiB are available{p.note}; its largest term is "
                        f"{name} ({size / GIB:.1f} GiB). Fix: {p.fix}")
        return None


def _trace_spec(shape: ModelShape, s: Settings, side: TrainSide, critic: bool, layers: int) -> dict[str, Any]:
    return {"config": shape.with_layers(layers), "world": s.world, "rows": side.rows, "seq_len": side.seq_len,
            "response_len": s.response_len, "critic": critic, "grad_ckpt": side.grad_ckpt,
            "remove_padding": side.remove_padding,
            "entropy_grad": s.entropy_grad,
            "param_dtype": s.param_dtype, "reduce_dtype": s.reduce_dtype}


def run_traces(specs: list[dict[str, Any]]) -> list[dict[str, int]]:
    """:func:`trainer.memtrace.trace` of each spec, in one fresh process (the fake process
    group is process-wide; torch and transformers are imported once), those traced before by
    the same code read from the trace cache (:func:`trace_cache`) instead."""
    cache = trace_cache()
    if cache is None:
        return _trace_now(specs)
    code = _code_digest()
    keys = [_trace_key(spec, code) for spec in specs]
    found = {key: peak for key in keys if (peak := _cached(cache, key)) is not None}
    todo = {key: spec for key, spec in zip(keys, specs, strict=True) if key not in found}
    if todo:
        for key, peak in zip(todo, _trace_now(list(todo.values())), strict=True):
            _keep(cache, key, peak)
            found[key] = peak
    return [found[key] for key in keys]


def _trace_now(specs: list[dict[str, Any]]) -> list[dict[str, int]]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "trainer.memtrace"], input=json.dumps(specs), env=env,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise PlanError(f"the FSDP2 memory trace failed: {done.stderr.strip().splitlines()[-1:]}")
    return [{k: int(v) for k, v in peak.items()} for peak in json.loads(done.stdout)]


TRACE_CACHE_ENV = "HPCRL_MEMTRACE_CACHE"


def trace_cache() -> Path | None:
    """The folder of traces kept between plans: a plan of the same model and micro-batch (a
    resubmission, `hpcrl doctor` after `hpcrl submit`) then skips its traces, seconds to tens of
    seconds each. `$HPCRL_MEMTRACE_CACHE`, else `$XDG_CACHE_HOME/hpcrl/memtrace` (`~/.cache`);
    `HPCRL_MEMTRACE_CACHE=off` keeps none. A trace is keyed by its spec and by the code and the
    torch and transformers versions that traced it (:func:`_trace_key`, :func:`_code_digest`)."""
    given = os.environ.get(TRACE_CACHE_ENV, "").strip()
    if given.lower() in ("off", "0", "none", "false"):
        return None
    if given:
        return Path(given).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hpcrl" / "memtrace"


_TRACED_BY = ("memtrace.py", "models.py", "parallel.py", "critic_model.py")
"""The trainer's modules whose code decides a trace: a change to any of them traces anew."""


def _code_digest() -> str:
    """The code and versions that decide a trace: the sources of :data:`_TRACED_BY` and the
    torch and transformers versions installed."""
    import hashlib
    from importlib import metadata

    digest = hashlib.sha256()
    here = Path(__file__).parent
    for name in _TRACED_BY:
        digest.update((here / name).read_bytes())
    for package in ("torch", "transformers"):
        try:
            digest.update(f"{package}={metadata.version(package)}".encode())
        except metadata.PackageNotFoundError:
            digest.update(f"{package}=none".encode())
    return digest.hexdigest()


def _trace_key(spec: dict[str, Any], code: str) -> str:
    """A trace's name in the cache: its spec and the code that traces it (:func:`_code_digest`)."""
    import hashlib

    return hashlib.sha256((json.dumps(spec, sort_keys=True) + code).encode()).hexdigest()


def _cached(cache: Path, key: str) -> dict[str, int] | None:
    try:
        peak = json.loads((cache / f"{key}.json").read_text())
    except (OSError, ValueError):
        return None
    return {k: int(v) for k, v in peak.items()} if isinstance(peak, dict) else None


def _keep(cache: Path, key: str, peak: dict[str, int]) -> None:
    """Written whole (a temporary file renamed); a cache that cannot be written costs the next
    plan its head start, never this plan."""
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tmp = cache / f".{key}.{os.getpid()}"
        tmp.write_text(json.dumps(peak))
        tmp.replace(cache / f"{key}.json")
    except OSError:
        pass


LAYERED = ("SHARDED_PARAM", "SHARDED_GRAD", "OPT", "ACT")
"""Tracker terms that grow with the decoder layers (shards, moments, saved activations); the
others (a gathered unit, collective buffers, temporaries) are one unit's at a time."""


def trace_layers(shape: ModelShape, layers: str = "auto") -> tuple[int, ...]:
    """The depths traced: all layers (`layers="full"`, or a model of at most 3), else 2 and 3
    (a single layer's peak falls at another moment of the step than a deep model's)."""
    return (shape.layers,) if layers == "full" or shape.layers <= 3 else (2, 3)


def extrapolate(shape: ModelShape, depths: tuple[int, ...], peaks: list[dict[str, int]]) -> dict[str, int]:
    """The terms at the model's depth: the layered ones linear through the two traced depths,
    the others as the deeper trace has them; `Total` their sum."""
    if len(depths) == 1:
        return peaks[0]
    (d1, d2), (one, two), n = depths, peaks, shape.layers
    out = {k: two[k] + (n - d2) * (two[k] - one[k]) // (d2 - d1) if k in LAYERED else two[k]
           for k in two if k != "Total"}
    out = {k: max(0, v) for k, v in out.items()}
    return {**out, "Total": sum(out.values())}


def traced_peaks(s: Settings, sides: list[tuple[ModelShape, TrainSide, bool]],
                 layers: str = "auto") -> list[dict[str, int]]:
    """Peak bytes per tracker category of one update step of each (model shape, side, is_critic),
    for the whole model."""
    return _traced([(s, shape, side, critic) for shape, side, critic in sides], layers)


def _traced(items: list[tuple[Settings, ModelShape, TrainSide, bool]], layers: str) -> list[dict[str, int]]:
    """:func:`traced_peaks` of each (settings, model shape, side, is_critic), every trace in one
    :func:`run_traces` call."""
    depths = [trace_layers(shape, layers) for _, shape, _, _ in items]
    specs = [_trace_spec(shape, s, side, critic, d) for (s, shape, side, critic), ds in zip(items, depths, strict=True)
             for d in ds]
    peaks, out = run_traces(specs), []
    for (_, shape, _, _), ds in zip(items, depths, strict=True):
        out.append(extrapolate(shape, ds, peaks[:len(ds)]))
        peaks = peaks[len(ds):]
    return out


def update_estimate(config: dict[str, Any], world: int, rows: int, seq_len: int, response_len: int, *,
                    grad_ckpt: bool = False, layers: str = "full", param_dtype: str = "fp32") -> dict[str, int]:
    """The actor update's traced peak per category on one of `world` ranks for a micro-batch of
    `rows` x `seq_len` tokens (compute in `param_dtype` over fp32 master weights, fp32 gradient
    reduction, no offload): what `bench/memory.py` calibrates."""
    return update_estimates(config, [(world, rows)], seq_len, response_len, grad_ckpt=grad_ckpt, layers=layers,
                            param_dtype=param_dtype)[0]


def update_estimates(config: dict[str, Any], cases: list[tuple[int, int]], seq_len: int, response_len: int, *,
                     grad_ckpt: bool = False, layers: str = "full", param_dtype: str = "fp32") -> list[dict[str, int]]:
    """:func:`update_estimate` of each (world, rows) of `cases`, traced in one process (each
    trace process imports torch and transformers first: seconds apiece)."""
    shape, items = ModelShape(config), []
    for world, rows in cases:
        side = TrainSide(rows, seq_len, False, False, grad_ckpt)
        s = Settings(world=world, device_bytes=0, response_len=response_len, actor=side, critic=None,
                     ref_resident=False, rollout_name="hf", tp=1, gpu_memory_utilization=0.0,
                     free_cache_engine=True, max_model_len=seq_len, max_num_seqs=1, max_num_batched_tokens=1,
                     bucket_bytes=0, param_dtype=param_dtype)
        items.append((s, shape, side, False))
    return _traced(items, layers)


TRAIN_TERMS = {"SHARDED_PARAM": "parameter shards", "UNSHARDED_PARAM": "gathered parameters",
               "SHARDED_GRAD": "gradient shards", "UNSHARDED_GRAD": "unsharded gradients",
               "OPT": "AdamW moments", "ACT": "activations",
               "TEMP": "temporaries (backward, optimizer step)", "ALL_GATHER": "all-gather buffers",
               "REDUCE_SCATTER": "reduce-scatter buffers", "BUFFER": "buffers", "INP": "inputs"}


def _update_phase(name: str, peak: dict[str, int], side: TrainSide, others: list[tuple[str, int]],
                  s: Settings, section: str, model_section: str) -> Phase:
    # Offload lowers the other phases, never this one: `param_offload` and `optimizer_offload` move
    # the shards and the AdamW moments onto the device for the whole update and back after it
    # (`Phases.on_device("update_actor", model, optim)`, verl's load/offload around `update_actor`),
    # so the traced peak, shards, gradients and moments included, is the update's peak. (Counting
    # them as host-resident under offload made the plan 1.27-1.86 x too low on an H200:
    # bench/README.md, "One-GPU check".)
    terms = {label: peak.get(k, 0) for k, label in TRAIN_TERMS.items()}
    shrink = (f"fewer micro-batch tokens (`{section}.ppo_max_token_len_per_gpu` with `use_dynamic_bsz`, "
              f"or `{section}.ppo_micro_batch_size_per_gpu`) or gradient checkpointing "
              f"(`{model_section}.enable_gradient_checkpointing=true`)")
    spread = ("more GPUs (`trainer.n_gpus_per_node`, `trainer.nnodes`), which shard the parameters, "
              "gradients and moments further (offload does not lower the update: it brings them back for it)")
    state = {TRAIN_TERMS[k] for k in ("SHARDED_PARAM", "SHARDED_GRAD", "OPT", "UNSHARDED_PARAM")}
    largest = max(terms, key=lambda k: terms[k])
    fix = f"{spread}; or {shrink}" if largest in state else f"{shrink}; or {spread}"
    return Phase(name, (*terms.items(), *others, ("CUDA context", CUDA_CONTEXT)), fix, s.device_bytes)


def _resident(shape: ModelShape, s: Settings, side: TrainSide | None) -> int:
    """A trained model's shards that stay on the device between its updates (fp32 master
    parameters and two AdamW moments), 0 when offloaded."""
    if side is None or side.param_offload:
        return 0
    per = shape.params() * 4 // s.world
    return per + (0 if side.optimizer_offload else 2 * per)


def pinned(nbytes: int) -> int:
    """A block of `nbytes` as torch's caching host allocator holds it: the next power of two."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 1 else nbytes


def host_terms(shape: ModelShape, s: Settings) -> list[tuple[str, int]]:
    """Host memory of one GPU worker process (see the module's note): `(term, bytes)`."""
    shard = [-(-n // s.world) * 4 for n in shape.tensors()]  # FSDP2 dim-0 shards of fp32 masters
    wbytes = DTYPE_BYTES[s.rollout_dtype]
    backup = 0
    if s.rollout_name == "vllm" and s.free_cache_engine and s.sleep_level == 1:
        backup = sum(pinned(-(-n // s.tp) * wbytes) for n in shape.tensors(fused=True))
    moments = 2 * sum(pinned(b) for b in shard) if s.actor.optimizer_offload else 0
    # the HF engine's own copy (several ranks) sleeps in host memory (`model.to("cpu")`, pageable)
    hf_copy = shape.params() * wbytes // s.tp if s.rollout_name == "hf" and s.world > 1 else 0
    return [("process baseline", HOST_PROCESS), ("HF rollout copy asleep", hf_copy),
            ("offloaded actor shards", sum(shard) if s.actor.param_offload else 0),
            ("offloaded reference shards", sum(shard) if s.ref_offloaded else 0),
            ("offloaded AdamW moments (pinned, power-of-two blocks)", moments),
            (f"vLLM level-{s.sleep_level} sleep backup (pinned, power-of-two blocks)", backup),
            ("reward model asleep", s.reward_model_bytes)]


def host_phase(shape: ModelShape, s: Settings, critic_shape: ModelShape | None = None) -> Phase:
    """The host memory of the busiest node (the head: its GPU workers and the driver) against
    `s.node_bytes`. The critic, when there is one, is counted like the actor, with its own shape
    (`critic_shape`, else the actor's)."""
    per_worker = host_terms(shape, s)
    if s.critic is not None:
        critic = replace(s, actor=s.critic, ref_offloaded=False, rollout_name="none", reward_model_bytes=0)
        per_worker += [(f"critic: {n}", b) for n, b in host_terms(critic_shape or shape, critic)[1:] if b]
    terms = [(f"{s.gpus_per_node} x {n}", b * s.gpus_per_node) for n, b in per_worker]
    if s.server_mode:  # vLLM's worker on each GPU; over several GPUs, each replica's engine core too
        cores = s.gpus_per_node // s.tp if s.tp > 1 else 0  # with one GPU the engine core is the worker
        terms += [(f"{s.gpus_per_node} x server-mode vLLM worker process", s.gpus_per_node * HOST_PROCESS),
                  (f"{cores} x server-mode vLLM engine core", cores * HOST_PROCESS)]
    return Phase("host memory", (*terms, ("driver", HOST_DRIVER)),
                 "a larger `slurm.mem` in the site profile (`0`: all of the node's memory), or less "
                 "offload (`actor_rollout_ref.actor.fsdp_config.optimizer_offload=false`, "
                 "`param_offload=false`, `actor_rollout_ref.ref.fsdp_config.param_offload=false`), or "
                 "fewer GPUs per node (`trainer.n_gpus_per_node`)", s.node_bytes,
                 " (`slurm.mem`)", "per node")


def plan(shape: ModelShape, s: Settings, name: str = "model", layers: str = "auto",
         critic_shape: ModelShape | None = None) -> Plan:
    """The per-device plan of every phase for `shape` (the critic's: `critic_shape`, else the
    same) under `s`."""
    critic_shape = critic_shape or shape
    params = shape.params()
    wbytes = DTYPE_BYTES[s.rollout_dtype]
    vllm = s.rollout_name == "vllm"
    share = int(s.gpu_memory_utilization * s.device_bytes) if vllm else 0
    engine_weights = params * wbytes // s.tp
    actor_res = _resident(shape, s, s.actor)
    critic_res = _resident(critic_shape, s, s.critic)
    ref_res = params * 4 // s.world if s.ref_resident else 0
    trainer_held = [("actor shards + AdamW moments", actor_res), ("critic shards + AdamW moments", critic_res),
                    ("reference shards", ref_res), ("CUDA context", CUDA_CONTEXT)]
    # asleep: weights and KV cache freed; on a pool of its own, the engine is not on these devices
    engine_idle = 0 if s.free_cache_engine or s.pool else share
    # server mode: vLLM's worker on this GPU is a process of its own, whose CUDA context stays while
    # it sleeps (inside vLLM's share while it generates, so not counted in the rollout phase)
    replica = [("server-mode vLLM worker's CUDA context", CUDA_CONTEXT if s.server_mode and vllm else 0)]
    notes = [f"trained in {s.param_dtype} (reduce {s.reduce_dtype}); rollout weights {s.rollout_dtype}",
             f"actor micro-batch {s.actor.rows} x {s.actor.seq_len} tokens on {s.world} ranks"]
    logits = s.actor.rows * (s.response_len + 1) * shape._get("vocab_size") * 4
    notes.append(f"one fp32 copy of the actor micro-batch's full-vocabulary logits: {logits / GIB:.1f} GiB "
                 "(the log-prob path keeps several: logits, the temperature-divided copy, log_softmax)")
    if shape.layers > 2 and layers != "full":
        notes.append(f"training phases traced with 2 and 3 layers, extrapolated to {shape.layers} (shards, "
                     "moments and saved activations per layer; one unit's gathered and temporary terms)")
    phases = []
    bucket = max(s.bucket_bytes, shape.largest_param() * 4)
    pool = "rollout pool: " if s.pool else ""  # the phases of the pool's devices, named so
    if s.pool:
        notes.append("a rollout pool of its own: the trainer's devices hold no engine; the pool's hold "
                     "the engine alone (phases `rollout pool: ...`)")
    if vllm:
        activations = (s.max_num_batched_tokens * (4 * shape._get("hidden_size") + 3 * shape._get(
            "intermediate_size")) // s.tp * wbytes + s.max_num_seqs * shape._get("vocab_size") * 4 * 2)
        kv_needed = shape.kv_bytes_per_token(wbytes) * s.max_model_len // s.tp
        graphs = 0 if s.enforce_eager else CUDA_GRAPHS
        kv_room = share - engine_weights - activations - graphs
        held = ((("CUDA context", CUDA_CONTEXT), ("received buckets", bucket * max(1, s.sync_buffers)))
                if s.pool else trainer_held)
        phases.append(Phase(f"{pool}rollout", (*held, ("vLLM share (gpu_memory_utilization x total)", share)),
                            "a lower `actor_rollout_ref.rollout.gpu_memory_utilization`" + ("" if s.pool else
                            ", or offload (`actor_rollout_ref.actor.fsdp_config.param_offload=true`, "
                            "`optimizer_offload=true`, `actor_rollout_ref.ref.fsdp_config.param_offload=true`)"),
                            s.device_bytes))
        phases.append(Phase(f"{pool}vLLM KV cache", (("vLLM weights", engine_weights), ("vLLM activations", activations),
                                              ("CUDA graphs (`enforce_eager=false`)", graphs),
                                              ("KV cache of one max_model_len sequence", kv_needed)),
                            "a higher `actor_rollout_ref.rollout.tensor_model_parallel_size` or a higher "
                            "`gpu_memory_utilization`", share,
                            f" (`gpu_memory_utilization`={s.gpu_memory_utilization} x total)"))
        notes.append(f"vLLM KV cache: {max(0, kv_room) / GIB:.1f} GiB per device, "
                     f"{max(0, kv_room) // max(1, kv_needed // s.max_model_len):,} tokens")
    sides = [(shape, s.actor, False)] + ([(critic_shape, s.critic, True)] if s.critic is not None else [])
    actor_peak, *critic_peaks = traced_peaks(s, sides, layers)
    phases.append(_update_phase("actor update", actor_peak, s.actor,
                                [("critic shards + AdamW moments", critic_res), ("reference shards", ref_res),
                                 ("idle vLLM", engine_idle), *replica], s, "actor_rollout_ref.actor",
                                "actor_rollout_ref.model"))
    if s.critic is not None:
        phases.append(_update_phase("critic update", critic_peaks[0], s.critic,
                                    [("actor shards + AdamW moments", actor_res), ("reference shards", ref_res),
                                     ("idle vLLM", engine_idle), *replica], s, "critic", "critic.model"))
    if s.pool:  # the trainer gathers and sends; the pool's engine loads a bucket at a time
        phases.append(Phase("weight sync", (*trainer_held, ("gathered bucket", bucket),
                                            ("broadcast buffers", bucket * s.sync_buffers)),
                            "a smaller `actor_rollout_ref.rollout.update_weights_bucket_megabytes`, or offload "
                            "(`fsdp_config.param_offload=true`)", s.device_bytes))
        if not vllm:  # vLLM's weights are inside its share (above)
            phases.append(Phase(f"{pool}HF engine", (("CUDA context", CUDA_CONTEXT), ("engine weights", engine_weights),
                                                      ("loaded buckets", bucket * max(1, s.sync_buffers))),
                                "a smaller model per pool device, or vLLM (`actor_rollout_ref.rollout.name=vllm`)",
                                s.device_bytes))
    else:
        sync_engine = engine_weights  # vLLM's or the HF engine's own copy
        phases.append(Phase("weight sync", (*trainer_held, ("rollout engine weights", sync_engine),
                                            ("gathered bucket", bucket), *replica),
                            "a smaller `actor_rollout_ref.rollout.update_weights_bucket_megabytes`, a higher "
                            "`tensor_model_parallel_size`, or offload (`fsdp_config.param_offload=true`)",
                            s.device_bytes))
    if s.reward_model_bytes:  # awake between rollout and training, as the rollout engine sleeps
        phases.append(Phase("reward model", (*trainer_held, ("reward model weights", s.reward_model_bytes),
                                             ("reward model forward", s.reward_model_forward_bytes), *replica),
                            "offload (`actor_rollout_ref.actor.fsdp_config.param_offload=true`, "
                            "`optimizer_offload=true`) or a smaller reward model", s.device_bytes))
    if s.node_bytes > 0:
        phases.append(host_phase(shape, s, critic_shape))
    return Plan(name, params, s.device_bytes, tuple(phases), tuple(notes))


def plan_config(cfg: Any, device_gib: float, *, layers: str = "auto", param_dtype: str | None = None,
                reduce_dtype: str | None = None, host_gib: float = 0.0) -> Plan:
    """The plan of a loaded trainer configuration (its actor model's `config.json`), in the
    configuration's precision unless `param_dtype` / `reduce_dtype` say otherwise; with
    `host_gib` (the job's memory per node) the host-memory phase too."""
    shape, s, critic_shape = _config_settings(cfg, device_gib, host_gib)
    s = replace(s, param_dtype=param_dtype or s.param_dtype, reduce_dtype=reduce_dtype or s.reduce_dtype)
    path = cfg.actor_rollout_ref.model.path
    made = plan(shape, s, name=Path(path).name or path, layers=layers, critic_shape=critic_shape)
    if cfg.actor_rollout_ref.model.uses_lora:  # the trace trains every weight
        made = replace(made, notes=(*made.notes, "LoRA (`lora_rank` > 0) is planned as full fine-tuning: "
                                    "gradients and AdamW moments of every weight, an over-estimate"))
    return made


def _edited_shape(path: str, key: str, override: Any) -> ModelShape:
    """The shape verl builds: `override_config` over the model's `config.json`."""
    shape = read_model(path, key)
    return ModelShape(apply_updates(copy.deepcopy(shape.config), override_kwargs(override)))


def _config_settings(cfg: Any, device_gib: float, host_gib: float
                     ) -> tuple[ModelShape, Settings, ModelShape | None]:
    """The actor model's shape, the plan's settings and the critic's shape (None without a
    critic) as a loaded configuration gives them."""
    s = settings_from_config(cfg, device_gib, host_gib)
    arr, c = cfg.actor_rollout_ref, cfg.critic
    try:
        shape = _edited_shape(arr.model.path, "actor_rollout_ref.model.path", arr.model.override_config)
        critic_shape = (_edited_shape(c.model.path, "critic.model.path", c.model.override_config)
                        if cfg.derived.use_critic else None)
        # the engine's context as `rollout_knobs` sizes it: the model's, unless set
        s = replace(s, max_model_len=max_model_len(cfg.actor_rollout_ref.rollout.max_model_len, shape.config))
    except ValueError as err:
        raise PlanError(str(err)) from None
    rm = cfg.reward_model
    if rm.enable and cfg.custom_reward_function.path is None and rm.model.path is not None:
        wbytes = DTYPE_BYTES[plan_dtype("bfloat16" if not rm.use_reward_loop else rm.rollout.get("dtype"))]  # null: bf16 on a GPU (`rm_dtype`); verl's legacy worker: bf16
        rm_shape = read_model(rm.model.path, "reward_model.model.path")
        s = replace(s, reward_model_bytes=rm_shape.params() * wbytes,
                    reward_model_forward_bytes=rm_forward_bytes(rm_shape, cfg, wbytes))
    return shape, s, critic_shape


def rm_forward_bytes(shape: Any, cfg: Any, wbytes: int) -> int:
    """One no-gradient forward of the reward model (`trainer.rewards.model`): its padded tokens
    (:data:`trainer.config.reward.RM_TOKENS_PER_FORWARD`, fewer with `reward_model.micro_batch_size_per_gpu`
    rows of a whole sequence, a longer row alone) times the widest moment of a decoder layer, the
    residual stream, its normed copy and the MLP's gate, up and product (3 x hidden + 3 x MLP)."""
    seq = cfg.data.max_prompt_length + cfg.data.max_response_length
    rows = cfg.reward_model.micro_batch_size_per_gpu
    tokens = max(seq, min(RM_TOKENS_PER_FORWARD, rows * seq if rows else RM_TOKENS_PER_FORWARD))
    h, i = int(shape.config["hidden_size"]), int(shape.config["intermediate_size"])
    return tokens * (3 * h + 3 * i) * wbytes


def host_plan(cfg: Any) -> Phase:
    """The plan's host-memory phase of a loaded configuration (the busiest node: its GPU workers
    and the driver), without tracing anything: the figure a rank killed for memory is set beside
    (:mod:`trainer.workers.memory_samples`). Its limit is unset (the job's `slurm.mem` is the
    launcher's to know)."""
    shape, s, critic_shape = _config_settings(cfg, 0.0, 0.0)
    return host_phase(shape, s, critic_shape)
