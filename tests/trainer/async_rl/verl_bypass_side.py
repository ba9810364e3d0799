"""verl 0.9.1's side of `test_bypass_vs_verl.py`, run by verl's interpreter:
`python verl_bypass_side.py IN.pt OUT.pt`. For each case it runs verl's bypass mode as its trainer
does: `apply_bypass_mode` on a `DataProto` (the old log-probs become the rollout's, the policy
loss becomes `bypass_mode` with the rollout-correction section), then the registered
`bypass_mode` loss on those old log-probs; OUT gets the loss, its gradient with respect to
`log_prob`, the metrics and the `old_log_probs` the batch ended with."""

from __future__ import annotations

import sys

import torch
from omegaconf import OmegaConf
from verl import DataProto
from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.trainer.ppo.rollout_corr_helper import apply_bypass_mode
from verl.workers.config import ActorConfig


def bypass(case: dict) -> dict:
    rc = OmegaConf.create({"rollout_is": case["rollout_is"], "rollout_is_threshold": case["rollout_is_threshold"],
                           "rollout_is_batch_normalize": case["rollout_is_batch_normalize"],
                           "rollout_rs": case["rollout_rs"], "rollout_rs_threshold": case["rollout_rs_threshold"],
                           "bypass_mode": True, "loss_type": case["loss_type"]})
    batch = DataProto.from_dict(tensors={"rollout_log_probs": case["rollout_log_prob"],
                                         "old_log_probs": torch.full_like(case["rollout_log_prob"], 99.0)})
    policy_loss = OmegaConf.create({"loss_mode": "vanilla"})
    apply_bypass_mode(batch, rc, policy_loss)
    config = ActorConfig(strategy="fsdp", clip_ratio=0.2, clip_ratio_low=case["clip_ratio_low"],
                         clip_ratio_high=case["clip_ratio_high"], ppo_mini_batch_size=1,
                         ppo_micro_batch_size_per_gpu=1, rollout_n=1)
    object.__setattr__(config, "policy_loss", policy_loss)
    log_prob = case["log_prob"].clone().requires_grad_(True)
    loss, metrics = get_policy_loss_fn(policy_loss["loss_mode"])(
        old_log_prob=batch.batch["old_log_probs"], log_prob=log_prob, advantages=case["advantages"],
        response_mask=case["response_mask"], loss_agg_mode=case["loss_agg_mode"], config=config)
    loss.backward()
    return {"loss": loss.detach(), "grad": log_prob.grad, "old_log_probs": batch.batch["old_log_probs"],
            "loss_mode": policy_loss["loss_mode"],
            "metrics": {k: float(v) for k, v in metrics.items()}}


def main() -> None:
    cases = torch.load(sys.argv[1], weights_only=False)
    torch.save([bypass(c) for c in cases], sys.argv[2])


if __name__ == "__main__":
    main()
