"""The single-process PPO loop on the tiny model and the toy task: it learns (GRPO, and GAE
with a critic), stops on request with a checkpoint and the requeue status, and a resumed run
reproduces an uninterrupted one exactly."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer import startup
from trainer.batch import micro_batch_rows
from trainer.checkpoint import full_state as ckpt
from trainer.config import load_config
from trainer.driver import PPODriver, run_training
from trainer.exit_codes import REQUEUE_EXIT_CODE
from trainer.metrics import read_jsonl
from trainer.models import load_actor
from trainer.rewards.toy import write_toy_digits
from trainer.stop import StopRequest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def toy_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("toy")
    write_toy_digits(out, train_size=512, val_size=16, seed=0)
    return out


def toy_overrides(model: Path, data: Path, run: Path, *extra: str) -> list[str]:
    return [
        f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'test.parquet'}",
        "data.max_prompt_length=16", "data.max_response_length=8",
        f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.actor.optim.lr=1e-3",
        "critic.optim.lr=1e-3", "trainer.val_before_train=false", "trainer.device=cpu",
        f"trainer.default_local_dir={run}", "trainer.logger=jsonl", "trainer.seed=7",
        "critic.ppo_micro_batch_size_per_gpu=64", *extra,  # a whole toy mini-batch per critic micro-batch
    ]


def weights(driver: PPODriver, group: str = "actor") -> dict[str, torch.Tensor]:
    """The full weights of rank 0 of the driver's actor (or critic) group."""
    return (driver.actor_group if group == "actor" else driver.critic_group).run_rank(0, "state_for_test")


def scores(run: Path) -> list[float]:
    return [r["critic/score/mean"] for r in read_jsonl(run / "metrics.jsonl")]


def test_micro_batch_rows_by_count() -> None:
    assert micro_batch_rows(5, 2) == [[0, 1], [2, 3], [4]]
    assert micro_batch_rows(3, None) == [[0, 1, 2]]


def test_stop_request_by_signal_and_by_file(tmp_path: Path) -> None:
    stop = StopRequest(tmp_path)
    stop.install()
    try:
        assert not stop.requested()
        os.kill(os.getpid(), signal.SIGUSR2)
        assert stop.requested() and "SIGUSR2" in stop.reason()
    finally:
        stop.uninstall()
    by_file = StopRequest(tmp_path)
    (tmp_path / "STOP").touch()
    assert by_file.requested()
    by_file.clear_stop_file()
    assert not by_file.requested()


def test_stop_signals_after_the_exit_status_is_decided_change_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once `python -m trainer` has its status, a late stop signal (a Ctrl-C that lands as the
    last step ends) is ignored instead of killing the finished process at interpreter exit."""
    from trainer.__main__ import main

    monkeypatch.setenv("HPCRL_RUN_DIR", str(tmp_path))  # launched by hpcrl: SIGINT stops too
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2)
    saved = {sig: signal.getsignal(sig) for sig in sigs}
    try:
        assert main(["no.such.key=1"]) == 2  # refused input: a status, decided
        assert all(signal.getsignal(sig) == signal.SIG_IGN for sig in sigs)
        os.kill(os.getpid(), signal.SIGUSR2)  # default action: end the process
        os.kill(os.getpid(), signal.SIGTERM)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


@pytest.mark.slow
def test_grpo_reward_rises_on_the_toy_task(tiny_model_dir: Path, toy_data: Path, tmp_path: Path) -> None:
    cfg = load_config(toy_overrides(
        tiny_model_dir, toy_data, tmp_path, "algorithm.adv_estimator=grpo",
        "data.train_batch_size=32", "actor_rollout_ref.rollout.n=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=16", "trainer.total_training_steps=12"))
    assert run_training(cfg) == 0
    s = scores(tmp_path)
    assert len(s) == 12
    assert sum(s[-3:]) / 3 > sum(s[:3]) / 3 + 0.4, s
    assert ckpt.find_latest_checkpoint(tmp_path) == tmp_path / "global_step_12"


@pytest.mark.slow
def test_gae_with_critic_reward_rises(tiny_model_dir: Path, toy_data: Path, tmp_path: Path) -> None:
    cfg = load_config(toy_overrides(
        tiny_model_dir, toy_data, tmp_path, "algorithm.adv_estimator=gae",
        "data.train_batch_size=32", "actor_rollout_ref.rollout.n=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=16", "trainer.total_training_steps=12"))
    assert run_training(cfg) == 0
    s = scores(tmp_path)
    assert sum(s[-3:]) / 3 > sum(s[:3]) / 3 + 0.3, s
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert all("critic/vf_loss" in r and "critic/values/mean" in r for r in rows)


def _small(model: Path, data: Path, run: Path, *extra: str) -> list[str]:
    return toy_overrides(
        model, data, run, "algorithm.adv_estimator=gae", "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.actor.use_kl_loss=true",
        "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive",
        "actor_rollout_ref.actor.optim.warmup_style=cosine", "actor_rollout_ref.actor.optim.lr_warmup_steps=1",
        "trainer.total_training_steps=3", "trainer.test_freq=2", *extra)


def test_stopped_and_resumed_equals_uninterrupted(tiny_model_dir: Path, toy_data: Path, tmp_path: Path) -> None:
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    # Uninterrupted: steps 1..3 in one process.
    whole = PPODriver(load_config(_small(tiny_model_dir, toy_data, straight)))
    assert whole.fit() == 0
    # Interrupted: a STOP file ends the run after step 2 (the CLI exits with the requeue
    # status), then a new process resumes and runs step 3.
    first = PPODriver(load_config(_small(tiny_model_dir, toy_data, broken)))
    first.stop.install = lambda *a: None  # type: ignore[method-assign]
    original = first.train_step

    def step_then_stop(examples):  # the request arrives during step 2
        metrics = original(examples)
        if first.global_step == 2:
            (broken / "STOP").touch()
        return metrics

    first.train_step = step_then_stop  # type: ignore[method-assign]
    assert first.fit() == REQUEUE_EXIT_CODE
    assert ckpt.find_latest_checkpoint(broken) == broken / "global_step_2"
    assert not (broken / "STOP").exists()
    resumed = PPODriver(load_config(_small(tiny_model_dir, toy_data, broken)))
    assert resumed.fit() == 0
    for name, tensor in weights(whole).items():
        assert torch.equal(tensor, weights(resumed)[name]), name
    for name, tensor in weights(whole, "critic").items():
        assert torch.equal(tensor, weights(resumed, "critic")[name]), name
    assert resumed.stages.kl_ctrl.value == whole.stages.kl_ctrl.value
    steps = [r["step"] for r in read_jsonl(broken / "metrics.jsonl")]
    assert steps == [1, 2, 3]
    assert scores(broken) == scores(straight)
    validated = [r for r in read_jsonl(broken / "metrics.jsonl") if "val-core/toy_digits/reward/mean@1" in r]
    assert [r["step"] for r in validated] == [2, 3]  # test_freq=2, and after the last step


def test_micro_batch_split_does_not_change_the_update(
        tiny_model_dir: Path, toy_data: Path, tmp_path: Path) -> None:
    """Under verl's model engine (`trainer.use_legacy_worker_impl=disable`, mini-batch
    normalisers) one step with micro-batches of 1, by tokens (also packed: only real tokens
    computed, for the actor, the reference and the critic), or none gives the same weights
    (verl's default worker takes micro-batch means: tests/trainer/test_parallel.py)."""
    updated = []
    for i, extra in enumerate((["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"],
                               ["actor_rollout_ref.actor.use_dynamic_bsz=true",
                                "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=40"],
                               [],
                               ["actor_rollout_ref.actor.use_dynamic_bsz=true",
                                "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=40",
                                "actor_rollout_ref.model.use_remove_padding=true",
                                "critic.model.use_remove_padding=true"])):
        over = [o for o in _small(tiny_model_dir, toy_data, tmp_path / str(i), *extra)
                if "ppo_micro_batch_size_per_gpu=2" not in o]
        over += ["trainer.total_training_steps=1", "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
                 "trainer.use_legacy_worker_impl=disable"]
        t = PPODriver(load_config(over))
        assert t.fit() == 0
        updated.append(weights(t))
    for name, tensor in updated[0].items():
        torch.testing.assert_close(tensor, updated[1][name], rtol=0, atol=1e-6)
        torch.testing.assert_close(tensor, updated[2][name], rtol=0, atol=1e-6)
        torch.testing.assert_close(tensor, updated[3][name], rtol=0, atol=1e-6)


def test_bf16_mixed_precision_trains_end_to_end_on_cpu(
        tiny_model_dir: Path, toy_data: Path, tmp_path: Path) -> None:
    """verl's mixed precision on one CPU rank: bf16 compute (autocast) for the actor, the
    reference and the critic, fp32 master weights that the step updates."""
    bf16 = [f"{section}.fsdp_config.mixed_precision.param_dtype=bf16" for section in
            ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic.model")]
    driver = PPODriver(load_config(_small(tiny_model_dir, toy_data, tmp_path, *bf16,
                                          "actor_rollout_ref.model.use_remove_padding=true",
                                          "trainer.total_training_steps=2")))
    assert driver.fit() == 0
    after, before = weights(driver), load_actor(tiny_model_dir).state_dict()
    assert all(t.dtype == torch.float32 for t in after.values())
    assert any(not torch.equal(after[k], before[k]) for k in before)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows if "actor/pg_loss" in r] == [1, 2]
    assert all(torch.isfinite(torch.tensor(r["actor/grad_norm"])) and r["actor/grad_norm"] > 0 for r in rows)


def test_cli_stop_file_gives_requeue_status_and_resume_continues(
        tiny_model_dir: Path, toy_data: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "STOP").touch()
    args = _small(tiny_model_dir, toy_data, run, "trainer.logger=['console','jsonl']",
                  "actor_rollout_ref.actor.use_dynamic_bsz=true",
                  "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "trainer", *args], capture_output=True, text=True,
                          env=env, check=False, timeout=300)
    assert proc.returncode == REQUEUE_EXIT_CODE, proc.stderr[-2000:]
    assert "please requeue" in proc.stdout
    assert ckpt.find_latest_checkpoint(run) == run / "global_step_1"
    hf = run / "global_step_1" / "huggingface"
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(hf).num_parameters() > 0
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1]
    # where the start-up went, for bench/first_step_lab.py: every phase once, in order
    marks = startup.read(run)["marks"]
    assert list(marks) == ["python", "imports", "workers_spawned", "models_built", "driver_ready",
                           "first_rollout", "first_step"], marks
    assert list(marks.values()) == sorted(marks.values()), marks


def test_on_policy_update_reuses_its_log_probs_and_matches_recomputation(
        tiny_model_dir: Path, toy_data: Path, tmp_path: Path) -> None:
    """One epoch, one mini-batch, no KL in the reward: the update's own log-probs stand in for
    the old ones; the weights and the entropy metric equal those of a run that recomputes them."""
    runs = {}
    for name in ("reuse", "recompute"):
        over = [o for o in _small(tiny_model_dir, toy_data, tmp_path / name)
                if not o.startswith(("algorithm.use_kl_in_reward", "actor_rollout_ref.actor.ppo_mini_batch_size"))]
        t = PPODriver(load_config([*over, "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                                    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                                    "trainer.total_training_steps=2", "trainer.test_freq=-1"]))
        if name == "recompute":
            t.stages.reuses_update_log_probs = lambda batch: False  # type: ignore[method-assign]
        assert t.fit() == 0
        runs[name] = (t, read_jsonl(tmp_path / name / "metrics.jsonl"))
    (reuse, reuse_rows), (recompute, recompute_rows) = runs["reuse"], runs["recompute"]
    assert all("timing_s/old_log_prob" not in r for r in reuse_rows)
    assert all("timing_s/old_log_prob" in r for r in recompute_rows)
    for a, b in zip(reuse_rows, recompute_rows, strict=True):
        assert a["actor/entropy"] == pytest.approx(b["actor/entropy"], abs=1e-5)
        assert a["critic/score/mean"] == b["critic/score/mean"]
        assert a["actor/ppo_kl"] == 0.0 and abs(b["actor/ppo_kl"]) < 1e-5
    for name, tensor in weights(reuse).items():
        # float noise between the two paths' forward passes moves Adam's first steps by ~1e-7;
        # a wrong old log-prob would move them by about the learning rate (1e-3 here)
        torch.testing.assert_close(tensor, weights(recompute)[name], rtol=0, atol=1e-5)


def test_calculate_log_probs_reports_how_far_the_sampler_is_from_the_actor(
        tiny_model_dir: Path, toy_data: Path, tmp_path: Path) -> None:
    """verl's `rollout.calculate_log_probs`: the engine's log-probs of the sampled tokens are kept
    and compared with the actor's. The HF engine samples with the actor's own weights, so the two
    agree; the on-policy update then recomputes the old log-probs (their own phase). verl's rollout
    correction runs on them (token importance weights here): its weights are about 1, and its
    off-policy metrics are logged under verl's names."""
    over = [o for o in _small(tiny_model_dir, toy_data, tmp_path)
            if not o.startswith(("algorithm.use_kl_in_reward", "actor_rollout_ref.actor.ppo_mini_batch_size"))]
    t = PPODriver(load_config([*over, "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                                "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.calculate_log_probs=true",
                                "algorithm.rollout_correction.rollout_is=token",
                                "trainer.total_training_steps=1", "trainer.test_freq=-1"]))
    assert t.fit() == 0
    row = read_jsonl(tmp_path / "metrics.jsonl")[0]
    assert "timing_s/old_log_prob" in row
    assert row["training/rollout_probs_diff_valid"] == 1.0
    assert 0.0 <= row["training/rollout_probs_diff_mean"] <= row["training/rollout_probs_diff_max"] < 1e-3, row
    assert row["training/rollout_actor_probs_pearson_corr"] > 0.999
    assert abs(row["rollout_corr/kl"]) < 1e-3 and abs(row["rollout_corr/rollout_is_mean"] - 1.0) < 1e-3
    assert row["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(1.0, abs=1e-3)


@pytest.mark.parametrize("score", ["float(len(solution_str.split()) % 2)", "0.5"], ids=["some", "all"])
def test_rows_with_zero_advantage_skip_the_update_and_change_nothing(
        tiny_model_dir: Path, toy_data: Path, tmp_path: Path, score: str) -> None:
    """GRPO groups whose samples scored alike have zero advantages: their rows skip the actor's
    forward and backward passes (all of them with a constant score) under verl's model engine
    (mini-batch normalisers), and the weights equal those of a run that passes every row. verl's
    default worker divides by micro-batch counts, which a skipped row would change: none is skipped."""
    reward = tmp_path / "reward.py"
    reward.write_text(f"def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      f"    return {score}\n")
    runs = {}
    for name in ("skip", "every_row"):
        over = [o for o in _small(tiny_model_dir, toy_data, tmp_path / name)
                if not o.startswith(("algorithm.", "actor_rollout_ref.actor.use_kl_loss"))]
        t = PPODriver(load_config([*over, "algorithm.adv_estimator=grpo", f"custom_reward_function.path={reward}",
                                    "trainer.test_freq=-1", "trainer.use_legacy_worker_impl=disable"]))
        if name == "every_row":
            t.stages.rows_to_update = lambda mini: list(range(len(mini)))  # type: ignore[method-assign]
        assert t.fit() == 0
        runs[name] = (t, [r["actor/skipped_row_frac"] for r in read_jsonl(tmp_path / name / "metrics.jsonl")])
    (skip, skipped), (every_row, none_skipped) = runs["skip"], runs["every_row"]
    assert none_skipped == [0.0] * 3
    if score == "0.5":
        assert skipped == [1.0] * 3
    else:
        assert any(0.0 < f < 1.0 for f in skipped), skipped
    start = load_actor(tiny_model_dir).state_dict()
    for name, tensor in weights(skip).items():
        torch.testing.assert_close(tensor, weights(every_row)[name], rtol=0, atol=1e-6)
        assert not torch.equal(tensor, start[name]), name  # the optimiser did step


def test_default_worker_keeps_rows_of_zero_advantage() -> None:
    """Under verl's default worker a row counts in its micro-batch's mean: none is skipped."""
    from trainer.batch import StepBatch
    from trainer.stages import update
    from trainer.step import Stages

    mask = torch.ones(3, 2)
    mini = StepBatch(examples=[], uids=[], input_ids=torch.zeros(3, 4, dtype=torch.long),
                     attention_mask=torch.ones(3, 4, dtype=torch.long), response_mask=mask,
                     advantages=torch.tensor([[0.0, 0.0], [1.0, 1.0], [0.0, 0.0]]))
    for impl, every_row in (("auto", True), ("enable", True), ("disable", False)):
        cfg = load_config(["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2",
                           f"trainer.use_legacy_worker_impl={impl}"])
        assert update.keeps_every_row(cfg, False) is every_row, impl
        assert update.keeps_every_row(cfg, True), impl
    assert Stages.rows_to_update(mini) == [1]


def test_remax_baseline_is_the_score_of_the_greedy_response(
        tiny_model_dir: Path, toy_data: Path, tmp_path: Path) -> None:
    """`adv_estimator=remax`: each prompt's greedy response, decoded by HF `generate` on the
    initial weights here, scored by the reward function, is the baseline of the prompt's rows;
    a run trains with it and times the greedy rollout as verl (`timing_s/gen_max`)."""
    from transformers import AutoTokenizer

    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(len(solution_str))\n")
    over = toy_overrides(tiny_model_dir, toy_data, tmp_path / "run", "algorithm.adv_estimator=remax",
                         "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
                         "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.total_training_steps=2",
                         f"custom_reward_function.path={reward}", "trainer.test_freq=-1")
    t = PPODriver(load_config(over))
    examples = t.loader.next_batch()
    batch = t.generate(examples)
    t.stages.compute_reward_baselines(examples, batch, t.global_step)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = load_actor(tiny_model_dir).eval()
    expected = []
    for e in examples:
        with torch.no_grad():
            out = model.generate(torch.tensor([e.prompt_ids]), attention_mask=torch.ones(1, len(e.prompt_ids)),
                                 do_sample=False, max_new_tokens=8, pad_token_id=tok.pad_token_id)
        new = out[0, len(e.prompt_ids):].tolist()
        if tok.eos_token_id in new:
            new = new[:new.index(tok.eos_token_id) + 1]
        expected.append(float(len(tok.decode(new, skip_special_tokens=True))))
    assert batch.reward_baselines is not None
    assert batch.reward_baselines.tolist() == [expected[uid] for uid in batch.uids]
    assert PPODriver(load_config([*over, f"trainer.default_local_dir={tmp_path / 'fit'}"])).fit() == 0
    rows = read_jsonl(tmp_path / "fit" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and all(r["timing_s/gen_max"] > 0 for r in rows)


def test_reward_managers_and_async_scoring_in_a_run(tiny_model_dir: Path, toy_data: Path, tmp_path: Path) -> None:
    """`batch` (one call with lists) scored in a thread while the workers compute, and `prime`
    (one process per call), give the run that `naive` scored inline gives; `dapo`'s overlong penalty lands in the scores and metrics."""
    fn = tmp_path / "reward.py"
    fn.write_text("from trainer.rewards.toy import toy_digits_score\n\n"
                  "def per_row(data_source, solution_str, ground_truth, extra_info=None):\n"
                  "    return toy_digits_score(solution_str)\n\n"
                  "def rows(data_sources, solution_strs, ground_truths, extra_infos, bonus=0.0):\n"
                  "    return [toy_digits_score(s) + bonus for s in solution_strs]\n")

    def run(name: str, *extra: str) -> list[dict]:
        cfg = load_config(toy_overrides(
            tiny_model_dir, toy_data, tmp_path / name, "algorithm.adv_estimator=grpo",
            "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.total_training_steps=2",
            f"custom_reward_function.path={fn}", "custom_reward_function.name=per_row", *extra))
        assert run_training(cfg) == 0
        return read_jsonl(tmp_path / name / "metrics.jsonl")

    naive = run("naive")
    batch = run("batch", "custom_reward_function.name=rows", "reward_model.reward_manager=batch",
                "reward_model.launch_reward_fn_async=true")
    assert [r["critic/score/mean"] for r in batch] == [r["critic/score/mean"] for r in naive]
    # `prime`: the same function called positionally in worker processes gives the same run
    prime = run("prime", "reward_model.reward_manager=prime")
    assert [r["critic/score/mean"] for r in prime] == [r["critic/score/mean"] for r in naive]
    dapo = run("dapo", "reward_model.reward_manager=dapo", "reward_model.overlong_buffer.enable=true",
               "reward_model.overlong_buffer.len=4", "reward_model.overlong_buffer.log=true")
    first = dapo[0]  # same seed: the first rollout equals naive's; only the penalty differs
    assert first["reward_extra/overlong_reward/mean"] < 0 < first["reward_extra/overlong/mean"]
    assert first["critic/score/mean"] == pytest.approx(
        naive[0]["critic/score/mean"] + first["reward_extra/overlong_reward/mean"], abs=1e-6)
    # verl's current spelling of the buffer gives the same run
    verl_keys = run("dapo_verl", "reward_model.reward_manager=dapo",
                    "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
                    "+reward_model.reward_kwargs.overlong_buffer_cfg.len=4",
                    "+reward_model.reward_kwargs.overlong_buffer_cfg.log=True",
                    "+reward_model.reward_kwargs.max_resp_len=${data.max_response_length}")
    assert [r["critic/score/mean"] for r in verl_keys] == [r["critic/score/mean"] for r in dapo]
    # `batch` passes `reward_model.reward_kwargs` to the function: +0.5 on every score
    bonus = run("bonus", "custom_reward_function.name=rows", "reward_model.reward_manager=batch",
                "+reward_model.reward_kwargs.bonus=0.5")
    assert bonus[0]["critic/score/mean"] == pytest.approx(naive[0]["critic/score/mean"] + 0.5)


def test_newer_verl_keys_act_in_a_run(tiny_model_dir: Path, toy_data: Path, tmp_path: Path) -> None:
    """`trainer.log_val_generations` logs the same validation prompts at every validation;
    `optim.clip_grad` (the newer name of `grad_clip`) clips the update."""
    reward = tmp_path / "reward.py"  # responses differ in length: no group is all ties
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return len(solution_str) / 10\n")
    cfg = load_config(toy_overrides(
        tiny_model_dir, toy_data, tmp_path, "algorithm.adv_estimator=grpo", "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "trainer.total_training_steps=2", "trainer.test_freq=1", "trainer.val_before_train=true",
        "trainer.log_val_generations=3", "actor_rollout_ref.actor.optim.clip_grad=1e-9",
        "trainer.logger=[console,jsonl]", f"custom_reward_function.path={reward}"))
    assert cfg.actor_rollout_ref.actor.grad_clip == 1e-9
    driver = PPODriver(cfg)
    before = {k: v.clone() for k, v in weights(driver).items()}
    assert driver.fit() == 0
    rows = read_jsonl(tmp_path / "val_generations.jsonl")
    assert [r["step"] for r in rows] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert [r["input"] for r in rows[:3]] == [r["input"] for r in rows[3:6]] == [r["input"] for r in rows[6:]]
    assert all(isinstance(r["output"], str) and isinstance(r["score"], float) for r in rows)
    # lr 1e-3: an unclipped Adam step moves weights by about 1e-3; clipped to a norm of 1e-9
    # the gradient is far below Adam's eps and the weights barely move
    moved = max(float((weights(driver)[k] - v).abs().max()) for k, v in before.items())
    assert 0 < moved < 1e-4, moved
    assert any(r.get("actor/grad_norm", 0) > 1e-6 for r in read_jsonl(tmp_path / "metrics.jsonl"))


def test_val_only_validates_once_with_standard_errors_and_trains_nothing(
        tiny_model_dir: Path, toy_data: Path, tmp_path: Path) -> None:
    """`trainer.val_only=true`: a model's baseline, the mean of the score and of every number
    the reward returns, each with its standard error, and no step, no checkpoint."""
    run = tmp_path / "val"
    driver = PPODriver(load_config(toy_overrides(tiny_model_dir, toy_data, run, "trainer.val_only=true",
                                                   "data.train_batch_size=8",
                                                   "actor_rollout_ref.actor.ppo_mini_batch_size=8")))
    assert driver.fit() == 0
    [row] = read_jsonl(run / "metrics.jsonl")
    assert row["step"] == 0
    mean, sem = row["val-core/toy_digits/reward/mean@1"], row["val-aux/toy_digits/reward/sem@1"]
    assert 0.0 <= mean <= 1.0 and sem >= 0.0
    assert ckpt.find_latest_checkpoint(run) is None
    with pytest.raises(Exception, match="needs a validation set"):
        load_config([o for o in toy_overrides(tiny_model_dir, toy_data, run, "trainer.val_only=true")
                     if not o.startswith("data.val_files")] + ["data.val_files=[]"])


def test_step_metrics_follow_verl(tiny_model_dir: Path, toy_data: Path, tmp_path: Path) -> None:
    """A GAE run of 3 steps, cosine schedule with 1 warm-up step: `actor/lr` and `critic/lr` are
    the rates each update used (verl logs them before the scheduler steps: 0 during the warm-up,
    then 1e-3 and 1e-3 * (1 + cos(pi/2)) / 2), and verl's other step metrics are there."""
    run = tmp_path / "run"
    assert run_training(load_config(_small(tiny_model_dir, toy_data, run, "trainer.test_freq=0"))) == 0
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["actor/lr"] for r in rows] == pytest.approx([0.0, 1e-3, 5e-4])
    assert [r["critic/lr"] for r in rows] == pytest.approx([1e-3] * 3)  # the critic's: constant, no warm-up
    for r in rows:
        assert math.isfinite(r["critic/vf_explained_var"]) and r["critic/vf_explained_var"] <= 1.0
        assert math.isfinite(r["critic/vpred_mean"])
        assert 0.0 <= r["prompt_length/clip_ratio"] <= 1.0
        assert r["timing_per_token_ms/gen"] == pytest.approx(
            r["timing_s/gen"] * 1000 / (r["response_length/mean"] * 8))  # 4 prompts x 2 responses
        assert r["timing_s/update_weights"] >= 0.0 and "timing_s/weight_sync" not in r
        assert r["perf/mfu/actor"] > 0.0 and r["perf/mfu/critic"] > 0.0  # CPU: verl's 448 GFLOP/s
        assert r["perf/max_memory_allocated_gb"] == 0.0  # no such counter on the CPU


def test_validation_with_several_samples_reports_verl_s_layout(
        tiny_model_dir: Path, toy_data: Path, tmp_path: Path) -> None:
    """`val_kwargs.n=2` sampled responses per prompt and a reward returning `acc` and `pred`:
    `val-core` holds `acc`'s mean, best and majority at 2; the reward and the spreads are
    `val-aux`; the best of 2 is at least the mean, the worst at most."""
    reward = tmp_path / "reward.py"
    reward.write_text("from trainer.rewards.toy import toy_digits_score\n\n"
                      "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    s = toy_digits_score(solution_str)\n"
                      "    return {'score': s, 'acc': s >= 0.5, 'pred': solution_str[:3]}\n")
    run = tmp_path / "val"
    driver = PPODriver(load_config(toy_overrides(
        tiny_model_dir, toy_data, run, "trainer.val_only=true", "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8", f"custom_reward_function.path={reward}",
        "actor_rollout_ref.rollout.val_kwargs.n=2", "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
        "actor_rollout_ref.rollout.val_kwargs.temperature=1.0", "data.val_batch_size=5")))
    assert driver.fit() == 0
    [row] = read_jsonl(run / "metrics.jsonl")
    src = "val-core/toy_digits/acc"
    assert {f"{src}/mean@2", f"{src}/best@2/mean", f"{src}/maj@2/mean"} <= set(row)
    assert "val-aux/toy_digits/acc/worst@2/mean" in row
    assert "val-aux/toy_digits/reward/mean@2" in row and "val-aux/toy_digits/acc/std@2" in row
    assert not any(k.startswith("val-core/toy_digits/reward") for k in row)
    assert row[f"{src}/best@2/mean"] >= row[f"{src}/mean@2"] >= row["val-aux/toy_digits/acc/worst@2/mean"]
