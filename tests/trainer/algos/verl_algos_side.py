"""verl 0.9.1's side of `test_algos_vs_verl.py`, run by verl's interpreter:
`python verl_algos_side.py IN.pt OUT.pt`. IN holds the cases (plain tensors and numbers); OUT gets,
per case, what verl's own functions return: `compute_policy_loss_geo_mean` (loss, its gradient
with respect to `log_prob`, metrics) and `compute_pf_ppo_reweight_data` (the rows it drew, after
`torch.manual_seed(seed)`, and the resampled fields)."""

from __future__ import annotations

import sys

import numpy as np
import torch
from verl import DataProto
from verl.trainer.ppo.core_algos import compute_pf_ppo_reweight_data, get_policy_loss_fn
from verl.workers.config import ActorConfig


def geo_mean(case: dict) -> dict:
    config = ActorConfig(strategy="fsdp", clip_ratio=case["clip_ratio"], clip_ratio_low=case["clip_ratio_low"],
                         clip_ratio_high=case["clip_ratio_high"], ppo_mini_batch_size=1,
                         ppo_micro_batch_size_per_gpu=1, rollout_n=1)
    log_prob = case["log_prob"].clone().requires_grad_(True)
    loss, metrics = get_policy_loss_fn("geo_mean")(
        old_log_prob=case["old_log_prob"], log_prob=log_prob, advantages=case["advantages"],
        response_mask=case["response_mask"], loss_agg_mode=case["loss_agg_mode"], config=config,
        rollout_is_weights=case["rollout_is_weights"])
    loss.backward()
    return {"loss": loss.detach(), "grad": log_prob.grad, "metrics": metrics}


def pf_ppo(case: dict) -> dict:
    scores = case["token_level_scores"]
    rows = scores.shape[0]
    data = DataProto.from_dict(tensors={"token_level_scores": scores, "row": torch.arange(rows)},
                               non_tensors={"uid": np.array([f"u{i}" for i in range(rows)], dtype=object)})
    torch.manual_seed(case["seed"])
    out = compute_pf_ppo_reweight_data(data, case["reweight_method"], case["weight_pow"])
    return {"rows": out.batch["row"], "token_level_scores": out.batch["token_level_scores"],
            "uid": list(out.non_tensor_batch["uid"])}


def main() -> None:
    cases = torch.load(sys.argv[1], weights_only=False)
    torch.save({"geo_mean": [geo_mean(c) for c in cases["geo_mean"]],
                "pf_ppo": [pf_ppo(c) for c in cases["pf_ppo"]]}, sys.argv[2])


if __name__ == "__main__":
    main()
