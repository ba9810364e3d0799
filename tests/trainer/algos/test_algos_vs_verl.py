"""`geo_mean` and PF-PPO against verl 0.9.1's own functions, on the same random tensors.

verl's side (`verl_algos_side.py`) runs in verl's interpreter (:func:`tests.verl_env.verl_python`)
as a subprocess: it loads the cases, calls `compute_policy_loss_geo_mean` (through verl's
`get_policy_loss_fn`, with a real `ActorConfig`) and `compute_pf_ppo_reweight_data` (on a real
`DataProto`, after `torch.manual_seed(seed)`: it draws from torch's global generator), and saves
what they return. This side computes the same with hpcrl's functions: the losses, their gradients
and the metrics must agree, and the rows drawn must be the same rows (hpcrl's generator seeded
with the same seed draws what verl's seeded global generator draws).
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import REPO
from tests.verl_env import verl_python
from trainer.algos import core_algos as ca
from trainer.algos import registry
from trainer.batch import StepBatch
from trainer.config import load_config
from trainer.stages.advantage import resample_pf_ppo

SIDE = Path(__file__).with_name("verl_algos_side.py")
AGG = {"dp_size": 4, "batch_num_tokens": 3.0, "global_batch_size": 2.0, "loss_scale_factor": 5.0}


def geo_mean_cases(gen: torch.Generator) -> list[dict[str, Any]]:
    """Batches of 1-8 rows x 1-17 tokens, empty rows, sequence- and token-level advantages (some
    zero), log-ratios up to 3 in scale, asymmetric clip ranges, with and without importance
    weights, under every `loss_agg_mode` (which geo_mean ignores, as verl)."""
    cases = []
    for i in range(48):
        rows, length = [(1, 1), (3, 5), (8, 17), (4, 9)][i % 4]
        mask = (torch.rand(rows, length, generator=gen) > 0.25).float()
        mask[0, 0] = 1.0
        if rows > 2:
            mask[-1] = 0.0  # a row without a response token
        old = torch.randn(rows, length, generator=gen) - 1.0
        scale = [0.01, 0.3, 3.0][i % 3]
        adv = torch.randn(rows, 1, generator=gen).expand(rows, length).clone() if i % 2 else torch.randn(
            rows, length, generator=gen)
        adv[torch.rand(rows, length, generator=gen) < 0.1] = 0.0
        weights = None if i % 4 < 2 else torch.rand(rows, length, generator=gen) * 2
        low, high = [(0.2, 0.2), (0.1, 0.28), (0.3, 0.05)][i % 3]
        cases.append({"clip_ratio": 0.2, "clip_ratio_low": low, "clip_ratio_high": high, "old_log_prob": old,
                      "log_prob": old + scale * torch.randn(rows, length, generator=gen), "advantages": adv,
                      "response_mask": mask, "loss_agg_mode": ca.LOSS_AGG_MODES[i % 4],
                      "rollout_is_weights": weights})
    return cases


def pf_ppo_cases(gen: torch.Generator) -> list[dict[str, Any]]:
    """Every reweighting on scores with ties (0/1 rewards), all equal, negative, continuous."""
    cases = []
    for i in range(36):
        rows, length = [(1, 3), (6, 4), (16, 7), (32, 2)][i % 4]
        kind = i % 4
        if kind == 0:
            per_row = torch.randint(0, 2, (rows,), generator=gen).float()
        elif kind == 1:
            per_row = torch.full((rows,), 0.5)
        elif kind == 2:
            per_row = -torch.rand(rows, generator=gen) * 3
        else:
            per_row = torch.randn(rows, generator=gen)
        scores = torch.zeros(rows, length)
        scores[:, -1] = per_row
        scores[:, 0] += 0.1 * torch.randn(rows, generator=gen) * (i % 3 == 0)
        cases.append({"token_level_scores": scores, "seed": 1000 + i,
                      "reweight_method": registry.PF_PPO_REWEIGHT_METHODS[i % 3],
                      "weight_pow": [2.0, 0.0, 1.0, 3.5][i % 4]})
    return cases


@pytest.fixture(scope="module")
def compared(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, list[dict]], dict[str, list[dict]]]:
    python = verl_python()
    gen = torch.Generator().manual_seed(20260)
    cases = {"geo_mean": geo_mean_cases(gen), "pf_ppo": pf_ppo_cases(gen)}
    folder = tmp_path_factory.mktemp("verl_algos")
    torch.save(cases, folder / "in.pt")
    done = subprocess.run([python, str(SIDE), str(folder / "in.pt"), str(folder / "out.pt")], cwd=REPO,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, f"verl's side failed:\n{done.stderr[-4000:]}"
    return cases, torch.load(folder / "out.pt", weights_only=False)


def test_geo_mean_is_verls(compared: tuple[dict[str, list[dict]], dict[str, list[dict]]]) -> None:
    cases, verl = compared
    loss_fn = registry.policy_loss("geo_mean")
    for i, (case, theirs) in enumerate(zip(cases["geo_mean"], verl["geo_mean"], strict=True)):
        params = ca.PolicyLossParams(clip_ratio_low=case["clip_ratio_low"], clip_ratio_high=case["clip_ratio_high"])
        log_prob = case["log_prob"].clone().requires_grad_(True)
        agg = AGG if i % 2 else {}  # the model engine's normalisers: ignored, as verl ignores them
        loss, metrics = loss_fn(case["old_log_prob"], log_prob, case["advantages"], case["response_mask"],
                                case["loss_agg_mode"], params, rollout_is_weights=case["rollout_is_weights"], **agg)
        loss.backward()
        torch.testing.assert_close(loss.detach(), theirs["loss"], rtol=1e-6, atol=1e-7, msg=f"case {i}: loss")
        torch.testing.assert_close(log_prob.grad, theirs["grad"], rtol=1e-6, atol=1e-7, msg=f"case {i}: gradient")
        assert metrics.keys() == theirs["metrics"].keys(), i
        for key, value in metrics.items():
            assert value == pytest.approx(theirs["metrics"][key], rel=1e-6, abs=1e-7), (i, key)


def test_pf_ppo_draws_verls_rows(compared: tuple[dict[str, list[dict]], dict[str, list[dict]]]) -> None:
    cases, verl = compared
    for i, (case, theirs) in enumerate(zip(cases["pf_ppo"], verl["pf_ppo"], strict=True)):
        scores = case["token_level_scores"].sum(dim=-1)
        rows = ca.pf_ppo_rows(scores, case["reweight_method"], case["weight_pow"],
                              torch.Generator().manual_seed(case["seed"]))
        assert rows.tolist() == theirs["rows"].tolist(), (i, case["reweight_method"])


def test_the_stage_resamples_every_field_as_verl(
        compared: tuple[dict[str, list[dict]], dict[str, list[dict]]]) -> None:
    """The advantage stage's redraw (`algorithm.use_pf_ppo`) on a whole batch: its token scores
    and uids come out as verl's resampled `token_level_scores` and `uid`."""
    cases, verl = compared
    for i, (case, theirs) in enumerate(zip(cases["pf_ppo"], verl["pf_ppo"], strict=True)):
        cfg = load_config(["algorithm.use_pf_ppo=true", f"algorithm.pf_ppo.reweight_method={case['reweight_method']}",
                           f"algorithm.pf_ppo.weight_pow={case['weight_pow']}"])
        scores = case["token_level_scores"]
        rows, length = scores.shape
        batch = StepBatch(examples=list(range(rows)), uids=[f"u{r}" for r in range(rows)],
                          input_ids=torch.arange(rows).unsqueeze(-1).expand(rows, length + 2).clone(),
                          attention_mask=torch.ones(rows, length + 2, dtype=torch.long),
                          response_mask=torch.ones(rows, length), token_scores=scores.clone())
        resample_pf_ppo(batch, cfg.algorithm, case["seed"])
        torch.testing.assert_close(batch.token_scores, theirs["token_level_scores"], rtol=0, atol=0)
        assert batch.uids == theirs["uid"], i
        assert batch.examples == theirs["rows"].tolist() == batch.input_ids[:, 0].tolist(), i
