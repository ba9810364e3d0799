"""HF `generate` behind the rollout interface (:mod:`trainer.rollout.base`): the CPU engine and
the one tests use; it samples with the training model itself unless given a copy to sync.

A generation is abortable (:meth:`HFRolloutEngine.abort`, from another thread): a stopping
check between decode steps ends it, and each unfinished row comes back partial, its tokens so far
with their log-probs (`RolloutBatch.aborted`, `finish_reason="abort"`)."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from trainer.agent.base import FinishReason, TokenOutput
from trainer.models import compute_log_probs, empty_actor, left_pad, materialize
from trainer.rollout.base import (
    RolloutBatch,
    SamplingParams,
    WeightBucket,
    WeightTally,
    response_mask_from_eos,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["HFRolloutEngine", "rollout_copy", "tensor_parallel"]


def _eos_ids(model: PreTrainedModel, eos_token_id: int | list[int] | None) -> list[int]:
    candidates = eos_token_id if eos_token_id is not None else model.generation_config.eos_token_id
    if candidates is None:
        candidates = model.config.eos_token_id
    if candidates is None:
        raise ValueError(
            "No EOS token id: the model's generation config and config have none and "
            "`eos_token_id` was not given. Fix: pass `eos_token_id=tokenizer.eos_token_id`."
        )
    return [candidates] if isinstance(candidates, int) else list(candidates)


#: How a decoder layer's projections split over a tensor-parallel group (Megatron's pattern,
#: as vLLM and transformers' `tp_plan` split Llama-like models): attention's q/k/v and the MLP's
#: gate/up by output columns (each rank its own heads and MLP slice), attention's output and the
#: MLP's down projection by input rows, each followed by one all-reduce.
COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


def tensor_parallel(model: PreTrainedModel, tp: int, world_size: int, device: str = "cpu") -> PreTrainedModel:
    """Shard `model`'s decoder projections (`COLWISE`, `ROWWISE`) over this rank's group of
    `tp` consecutive ranks (torch tensor parallelism: DTensor weights, each rank its share of the
    heads and of the MLP), in place; every rank of the group must then run the same forward
    passes. A collective over all `world_size` ranks (it builds the groups); `device`: the
    type of the devices the group computes on. The model may be on the meta device."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    cfg = model.config
    sizes = {"num_attention_heads": cfg.num_attention_heads,
             "num_key_value_heads": getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
             "intermediate_size": getattr(cfg, "intermediate_size", 0)}
    uneven = {k: v for k, v in sizes.items() if v % tp}
    if uneven:
        raise ValueError(
            f"`actor_rollout_ref.rollout.tensor_model_parallel_size={tp}` must divide the model's "
            + ", ".join(f"`{k}`={v}" for k, v in uneven.items())
            + " (each rank of a tensor-parallel group holds an equal share). Fix: a divisor of them")
    plan: dict[str, Any] = {}
    for name, _ in model.named_modules():
        if name.endswith(COLWISE):
            plan[name] = ColwiseParallel()
        elif name.endswith(ROWWISE):
            plan[name] = RowwiseParallel()
    if not plan:
        raise ValueError(
            f"tensor-parallel HF rollout: {type(model).__name__} has none of the projections it "
            f"splits ({', '.join(COLWISE + ROWWISE)}). Fix: "
            "`actor_rollout_ref.rollout.tensor_model_parallel_size=1`, or `rollout.name=vllm`")
    mesh = init_device_mesh(device, (world_size // tp, tp), mesh_dim_names=("dp", "tp"))["tp"]
    parallelize_module(model, mesh, plan)
    return model


def rollout_copy(path: str, tp: int, world_size: int, device: torch.device, *,
                 dtype: torch.dtype = torch.float32, trust_remote_code: bool = False,
                 config_updates: Mapping[str, Any] | None = None) -> PreTrainedModel:
    """The HF engine's own model for a sharded actor: built empty, split over the `tp` ranks of
    this rank's group when `tp` > 1, then given memory on `device`; the first weight sync (before
    any rollout) gives it the actor's values. A rank holds its shares only, never the whole
    model, and reads nothing of the checkpoint on disk. `config_updates`: the actor's
    (:func:`trainer.hf_overrides.config_updates`), so the copy is the trained model."""
    copy = empty_actor(path, dtype=dtype, trust_remote_code=trust_remote_code, config_updates=config_updates)
    if tp > 1:
        copy = tensor_parallel(copy, tp, world_size, device.type)
    return materialize(copy, device).eval()  # type: ignore[return-value]


def _local_part(target: torch.Tensor, whole: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the tensor to write, what to write): for a tensor-parallel (DTensor) weight, this
    rank's local shard and the matching slice of the whole tensor; else both as they are."""
    placements = getattr(target, "placements", None)
    if placements is None:
        return target, whole
    local, mesh = target.to_local(), target.device_mesh  # type: ignore[attr-defined]
    for dim, placement in enumerate(placements):
        if placement.is_shard():
            whole = whole.chunk(mesh.size(dim), dim=placement.dim)[mesh.get_local_rank(dim)]
    return local, whole


def _copy_bucket(targets: dict[str, torch.Tensor], bucket: WeightBucket) -> None:
    for name, tensor in bucket:
        if name not in targets:
            raise KeyError(f"weight sync: the rollout model has no `{name}`")
        local, part = _local_part(targets[name], tensor)
        local.copy_(part)


class HFRolloutEngine:
    """Rollout through transformers' ``generate`` (CPU or one GPU).

    ``model`` may be the actor itself (weights shared, nothing to sync) or a separate copy
    kept current with :meth:`sync_weights`. With ``offload=True``, :meth:`sleep` moves a model
    that lives on an accelerator to the CPU and :meth:`wake_up` moves it back.
    """

    collective = False
    """Each rank generates alone (see :class:`~trainer.rollout.base.RolloutEngine`)."""
    needs_sync = False
    """Sleeping moves the model, it never discards it."""

    def __init__(
        self,
        model: PreTrainedModel,
        pad_token_id: int,
        eos_token_id: int | list[int] | None = None,
        *,
        micro_batch_size: int | None = None,
        offload: bool = False,
    ) -> None:
        self.model = model
        self.pad_token_id = int(pad_token_id)
        self.eos_token_ids = _eos_ids(model, eos_token_id)
        self.micro_batch_size = micro_batch_size
        self.offload = offload
        self._device = next(model.parameters()).device
        self._abort = threading.Event()

    def abort(self) -> None:
        """End the generation in flight at its next decode step (callable from another thread);
        every later one ends before its first token, until :meth:`resume`. The rows not finished
        come back partial (verl's `abort_all_requests`)."""
        self._abort.set()

    def resume(self) -> None:
        """Generate in full again after :meth:`abort` (verl's `resume_generation`)."""
        self._abort.clear()

    @torch.no_grad()
    def sync_weights(self, buckets: Iterable[WeightBucket]) -> None:
        """Copy each bucket into the model's own tensors as it arrives (no second copy of the
        model); every state-dict entry must arrive exactly once."""
        targets = self.model.state_dict()  # shares storage with the parameters and buffers
        tally = WeightTally()
        for bucket in buckets:
            tally.add(bucket)
            _copy_bucket(targets, bucket)  # keeps no reference to the bucket's tensors
        tally.check(targets)

    def sleep(self) -> None:
        if self.offload and self._device.type != "cpu":
            self.model.to("cpu")  # type: ignore[arg-type]
            torch.cuda.empty_cache()

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Move the model back (tag `weights`); it has no KV cache to keep between rollouts."""
        if self.offload and self._device.type != "cpu" and (tags is None or "weights" in tags):
            self.model.to(self._device)  # type: ignore[arg-type]

    def _generation_config(self, params: SamplingParams) -> object:
        from transformers import GenerationConfig

        sample = not params.greedy
        return GenerationConfig(
            do_sample=sample,
            temperature=params.temperature if sample else None,
            top_p=params.top_p if sample else None,
            top_k=(params.top_k if params.top_k > 0 else 0) if sample else None,
            max_new_tokens=params.max_response_length,
            eos_token_id=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            return_dict_in_generate=True,
            use_cache=True,
        )

    def _stopping(self) -> object:
        """The abort check HF runs after every decode step."""
        from transformers import StoppingCriteria, StoppingCriteriaList

        aborted = self._abort

        class Aborted(StoppingCriteria):
            def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
                return torch.full((input_ids.shape[0],), aborted.is_set(), dtype=torch.bool, device=input_ids.device)

        return StoppingCriteriaList([Aborted()])

    def _generate_chunk(self, ids: torch.Tensor, mask: torch.Tensor, params: SamplingParams
                        ) -> tuple[torch.Tensor, int, bool]:
        """The sampled response tokens, padded to `max_response_length`, the decode steps made
        and whether an abort ended them. No logits are kept while decoding (`output_logits`
        would hold rows x vocabulary floats per step): the log-probs come from one forward pass
        over the finished rows (:meth:`generate`)."""
        blank = torch.full((ids.shape[0], params.max_response_length), self.pad_token_id, dtype=torch.long)
        if self._abort.is_set():  # aborted before it began: nothing generated
            return blank, 0, True
        # Inference mode (no autograd bookkeeping at all) is cheaper than no_grad; its tensors
        # cannot enter a backward pass, so what leaves is cloned outside it.
        with torch.inference_mode():
            out = self.model.generate(  # type: ignore[operator]
                input_ids=ids.to(self._device),
                attention_mask=mask.to(self._device),
                generation_config=self._generation_config(params),
                stopping_criteria=self._stopping(),
            )
            response = out.sequences[:, ids.shape[1] :].cpu()
        steps = int(response.shape[1])
        blank[:, :steps] = response
        return blank, steps, steps < params.max_response_length and self._abort.is_set()

    def _log_probs(self, ids: torch.Tensor, mask: torch.Tensor, response: torch.Tensor,
                   response_mask: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
        """The sampling policy's log-probs and entropies of the responses (at
        `logprob_temperature`), micro-batch by micro-batch, zero after EOS."""
        with torch.inference_mode():
            log_probs, entropy = compute_log_probs(
                self.model, torch.cat([ids, response], 1), torch.cat([mask, response_mask.to(mask.dtype)], 1),
                response.shape[1], temperature=params.logprob_temperature,
                micro_batch_size=self.micro_batch_size, calculate_entropy=True)
        assert entropy is not None
        return log_probs.cpu().clone(), entropy.cpu().clone()

    def generate(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams
    ) -> RolloutBatch:
        prompt_index = torch.arange(prompt_ids.shape[0]).repeat_interleave(params.n)
        # The rows stay on the host, as the responses do (`_generate_chunk`): each chunk and the
        # log-prob pass move to the model's device themselves. A caller may hand device tensors
        # (the actor does, on a GPU): found by bench/gpu_check.py on an H200, where concatenating
        # the device prompts with the host responses failed.
        ids, mask = prompt_ids.cpu()[prompt_index], prompt_mask.cpu()[prompt_index]
        size = self.micro_batch_size or ids.shape[0]
        was_training = self.model.training
        self.model.eval()
        try:
            chunks = [self._generate_chunk(ids[i : i + size], mask[i : i + size], params)
                      for i in range(0, ids.shape[0], size)]
            response = torch.cat([c[0] for c in chunks])
            steps = torch.cat([torch.full((len(c[0]),), c[1]) for c in chunks])
            cut = torch.cat([torch.full((len(c[0]),), c[2]) for c in chunks])
            generated = torch.arange(response.shape[1]) < steps[:, None]
            response_mask = response_mask_from_eos(response, self.eos_token_ids) * generated
            # an aborted row: its tokens so far, no EOS among them (a row that ended is finished)
            aborted = cut & ~(torch.isin(response, torch.tensor(self.eos_token_ids)) & generated).any(dim=1)
            response = torch.where(response_mask.bool(), response, self.pad_token_id)
            # the log-probs under the weights that sampled the tokens: before any new ones load
            if response_mask.any():
                log_probs, entropy = self._log_probs(ids, mask, response, response_mask, params)
            else:  # aborted before the first token
                log_probs = entropy = torch.zeros(response.shape, dtype=torch.float32)
        finally:
            self.model.train(was_training)
        return RolloutBatch(ids, mask, response, response_mask, log_probs, prompt_index, entropy,
                            aborted=aborted if bool(aborted.any()) else None)

    def generate_tokens(self, prompts: list[list[int]], params: SamplingParams, max_tokens: list[int]
                        ) -> list[TokenOutput]:
        """One response per prompt (token ids, no padding), at most `max_tokens[i]` tokens for
        prompt `i`: one :meth:`generate` of the longest limit, each row cut at its own. Greedy
        rows equal what a per-row limit gives; sampled rows follow the same distribution, from
        other draws of the generator. Log-probs come with every row (the engine computes them).
        A row the engine aborted (:meth:`abort`) ends with `finish_reason="abort"`, partial."""
        if len(max_tokens) != len(prompts) or not prompts:
            raise ValueError(f"generate_tokens: {len(prompts)} prompts and {len(max_tokens)} `max_tokens`; "
                             "give at least one prompt and one limit per prompt")
        ids, mask = left_pad(prompts, self.pad_token_id)
        batch = self.generate(ids, mask, replace(params, n=1, max_response_length=max(max_tokens)))
        outputs = []
        for row, limit in enumerate(max_tokens):
            length = min(int(batch.response_mask[row].sum()), limit)
            tokens = batch.response_ids[row, :length].tolist()
            reason: FinishReason = "stop" if tokens and tokens[-1] in self.eos_token_ids else "length"
            if batch.aborted is not None and batch.aborted[row] and length < limit:
                reason = "abort"
            outputs.append(TokenOutput(tokens, batch.log_probs[row, :length].tolist(), reason))
        return outputs
