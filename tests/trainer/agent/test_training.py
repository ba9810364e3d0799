"""The trainer on multi-turn rows end to end (the tiny model with the tools tokenizer, HF
rollout on the actor's own weights): verl's tool agent loop with verl's gsm8k interaction, so every
trajectory has user turns between the model's; the engine's log-probs of the model's tokens equal
the actor's recomputation over the whole conversation (the tokens line up), and the steps log
`num_turns/*` and `agent_loop/*`."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from trainer.agent.interactions import GSM8K_INTERACTION_CONFIG, with_gsm8k_interaction
from trainer.config import load_config
from trainer.data import read_rows, write_split
from trainer.driver import PPODriver
from trainer.metrics import read_jsonl
from trainer.rewards.toy import write_toy_digits


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from trainer.tiny import save_tiny

    root = tmp_path_factory.mktemp("multi_turn")
    save_tiny(root / "model", seed=0, tools=True)
    write_toy_digits(root / "toy", train_size=16, val_size=4, seed=0)
    for split in ("train", "test"):  # as verl's gsm8k_multiturn_w_interaction data: a user answers
        rows = read_rows([root / "toy" / f"{split}.parquet"])
        write_split(with_gsm8k_interaction(rows), root / "data", split)
    (root / "interaction.yaml").write_text(yaml.safe_dump(GSM8K_INTERACTION_CONFIG))
    return root


def test_multi_turn_rows_train_and_the_engine_s_log_probs_equal_the_actor_s(assets: Path, tmp_path: Path) -> None:
    data = assets / "data"
    cfg = load_config([
        f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'test.parquet'}",
        "data.max_prompt_length=24", "data.max_response_length=24", f"actor_rollout_ref.model.path={assets / 'model'}",
        "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.calculate_log_probs=true",
        f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={assets / 'interaction.yaml'}",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3", "actor_rollout_ref.rollout.n=2",
        "algorithm.adv_estimator=grpo", "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.optim.lr=1e-3", "trainer.val_before_train=false", "trainer.device=cpu",
        f"trainer.default_local_dir={tmp_path}", "trainer.logger=jsonl", "trainer.seed=3",
        "trainer.total_training_steps=2", "trainer.test_freq=-1"])
    assert PPODriver(cfg).fit() == 0
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["num_turns/max"] > 2, row  # the interaction's user turns between the model's
        assert "agent_loop/generate_sequences/mean" in row and "agent_loop/slowest/response_length" in row
        # the engine sampled each turn from the conversation so far; the actor recomputes over the
        # packed rows: equal probabilities only if every turn's tokens are where generation put them
        assert row["training/rollout_probs_diff_max"] < 1e-3, row
        assert row["training/rollout_actor_probs_pearson_corr"] > 0.999, row


def interaction_run_overrides(assets: Path, tmp_path: Path, *extra: str) -> list[str]:
    """Two GRPO steps on the interaction rows, the engine's log-probs kept (fp32), `extra` added."""
    data = assets / "data"
    return [
        f"data.train_files={data / 'train.parquet'}", "data.max_prompt_length=24", "data.max_response_length=24",
        f"actor_rollout_ref.model.path={assets / 'model'}",
        "actor_rollout_ref.rollout.calculate_log_probs=true", "actor_rollout_ref.rollout.dtype=float32",
        f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={assets / 'interaction.yaml'}",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3", "actor_rollout_ref.rollout.n=2",
        "algorithm.adv_estimator=grpo", "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.optim.lr=1e-3", "trainer.val_before_train=false", "trainer.device=cpu",
        f"trainer.default_local_dir={tmp_path}", "trainer.logger=jsonl", "trainer.seed=3", "trainer.save_freq=-1",
        "trainer.total_training_steps=2", "trainer.test_freq=-1", *extra,
    ]


@pytest.mark.vllm
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_vllm_engines_train_multi_turn_rows_whose_tokens_line_up(assets: Path, tmp_path: Path, monkeypatch,
                                                                 mode: str) -> None:
    """On vLLM (the CPU build): `sync`, the in-process engine with every live trajectory's turn
    batched; `async`, a server-mode replica (its engine core in a process of its own) serving
    turns as they come, synced from the actor by the streamed buckets before each rollout. Either
    way vLLM's log-probs of the model's tokens equal the actor's recomputation over the whole
    conversation (fp32: rounding apart).

    The server-mode run is traced to MLflow too (`rollout.trace.backend=mlflow`): a trace per
    trajectory, whose `generate` spans hold the tokens vLLM sampled, in the order they stand in
    the trajectory's response, with the interaction's turns between them."""
    from tests.trainer.rollout.vllm_support import require_vllm

    require_vllm()
    traced = mode == "async"
    if traced:
        monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
        monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    data = assets / "data"
    cfg = load_config(interaction_run_overrides(
        assets, tmp_path, f"data.val_files={data / 'test.parquet'}", "actor_rollout_ref.rollout.name=vllm",
        f"actor_rollout_ref.rollout.mode={mode}",
        *(["trainer.logger=[jsonl,mlflow]", "actor_rollout_ref.rollout.trace.backend=mlflow"] if traced else [])))
    driver = PPODriver(cfg)
    engine = driver.actor_group.run_rank(0, "rollout_kind")
    assert engine == ("ServerEngine" if mode == "async" else "VLLMRolloutEngine")
    assert driver.fit() == 0
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]  # step 2 sampled with the weights step 1 trained
    for row in rows:
        assert row["num_turns/max"] > 2, row
        assert row["training/rollout_probs_diff_max"] < 1e-4, row
    if traced:
        check_traces_hold_the_sampled_turns(tmp_path, cfg.trainer.project_name, steps=2, per_step=8)
        from trainer.rollout.vllm_server import close_open_engines

        # the driver's one replica is still open (the fixture `_replicas_closed` would close it)
        assert close_open_engines() == 1 and close_open_engines() == 0


def check_traces_hold_the_sampled_turns(run_dir: Path, project: str, steps: int, per_step: int) -> None:
    """One trace per trajectory and step in `<run_dir>/mlruns.db`; each trace's `generate` spans,
    in the order they ran, are the model's turns of its response: each turn's sampled tokens are
    the next run of tokens under `response_mask` 1 (the last one possibly cut at the response's
    length), and every masked token is one of them (the interaction's turns, mask 0, between).
    With 24 response tokens most trajectories are one model turn and the interaction's answer."""
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{run_dir.resolve() / 'mlruns.db'}")
    experiment = mlflow.MlflowClient().get_experiment_by_name(project).experiment_id
    traces = mlflow.search_traces(locations=[experiment], return_type="list")
    answered = 0
    assert sorted(t.info.tags["step"] for t in traces) == sorted([str(s) for s in range(1, steps + 1)] * per_step)
    for trace in traces:
        name = trace.info.trace_id
        (root,) = [s for s in trace.data.spans if s.name == "agent_loop"]
        turns = sorted((s for s in trace.data.spans if s.name == "generate"), key=lambda s: s.start_time_ns)
        assert turns and {s.name for s in trace.data.spans} == {"agent_loop", "generate"}, name
        response, mask = root.outputs["response_ids"], root.outputs["response_mask"]
        at = sampled = 0
        for i, turn in enumerate(turns):
            tokens = turn.outputs["token_ids"]
            while at < len(response) and mask[at] == 0:  # the interaction's turn before this one
                at += 1
            kept = response[at:at + len(tokens)]
            assert tokens and kept == tokens[:len(kept)] and all(mask[at:at + len(kept)]), (name, i)
            assert len(kept) == len(tokens) or i == len(turns) - 1, (name, i)  # only the last is cut
            at += len(kept)
            sampled += len(kept)
        assert sampled == sum(mask), name
        answered += 0 in mask
    assert answered  # the interaction's turns are in the traced responses, between the model's


@pytest.mark.slow
@pytest.mark.parametrize(("name", "mode"), [("hf", "sync"), pytest.param("vllm", "sync", marks=pytest.mark.vllm),
                                            pytest.param("vllm", "async", marks=pytest.mark.vllm)])
def test_a_tensor_parallel_engine_trains_multi_turn_rows(assets: Path, tmp_path: Path, monkeypatch, name: str,
                                                         mode: str) -> None:
    """Two Ray ranks forming one engine (`tensor_model_parallel_size=2`), every trajectory and its
    interaction run by the first rank:

    - `sync`: the HF engine's split copy, or vLLM's external launcher; the second rank makes the
      same engine calls (`trainer.agent.servers.EngineLeader`) and generates the same tokens;
    - `async`: one server-mode replica whose two workers are vLLM's processes, started by the
      first rank over both ranks' devices; the second rank only takes part in the weight sync
      (`trainer.rollout.vllm_server.ReplicaMember`) and generates nothing itself.

    Either way turns line up and the run trains."""
    import ray

    from tests.trainer.test_distributed import no_ray_address

    if name == "vllm":
        from tests.trainer.rollout.vllm_support import require_vllm

        require_vllm()
    no_ray_address(monkeypatch)
    cfg = load_config(interaction_run_overrides(
        assets, tmp_path, f"actor_rollout_ref.rollout.name={name}", f"actor_rollout_ref.rollout.mode={mode}",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "trainer.n_gpus_per_node=2"))
    try:
        driver = PPODriver(cfg)
        kinds = [driver.actor_group.run_rank(rank, "rollout_kind") for rank in (0, 1)]
        assert driver.fit() == 0
        loops = [driver.actor_group.run_rank(rank, "runs_agent_loops") for rank in (0, 1)]
    finally:
        ray.shutdown()
    assert loops == [True, False]  # only the engine's first rank loads the tools and runs loops
    server = name == "vllm" and mode == "async"
    assert kinds == (["ServerEngine", "ReplicaMember"] if server else
                     ["VLLMRolloutEngine"] * 2 if name == "vllm" else ["HFRolloutEngine"] * 2)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["num_turns/max"] > 2, row
        assert row["dp/rank_0/gen_rows"] == row["dp/rank_1/gen_rows"] == 4, row  # one engine: every prompt
        assert row["dp/rank_0/gen_tokens"] > 0, row
        # a collective engine's ranks generate alike; a replica's second rank drives no engine
        assert row["dp/rank_1/gen_tokens"] == (0 if server else row["dp/rank_0/gen_tokens"]), row
        assert row["training/rollout_probs_diff_max"] < 1e-3, row


def test_a_traced_run_logs_its_metrics_and_every_trajectory_to_one_mlflow_store(assets: Path, tmp_path: Path,
                                                                                   monkeypatch) -> None:
    """verl's MLflow lines (`trainer.logger` with `mlflow`, `rollout.trace.backend=mlflow`) on a
    real run of single-turn rows: the step's metrics and one trace per trajectory (the rows run
    through `single_turn_agent` to be traced, as in verl) land in `<run_dir>/mlruns.db`."""
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # nothing may land in the working directory (MLflow's default)
    toy = assets / "toy"
    cfg = load_config([
        f"data.train_files={toy / 'train.parquet'}", "data.max_prompt_length=24", "data.max_response_length=8",
        f"actor_rollout_ref.model.path={assets / 'model'}", "actor_rollout_ref.rollout.name=hf",
        "actor_rollout_ref.rollout.n=2", "algorithm.adv_estimator=grpo", "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.val_before_train=false", "trainer.device=cpu",
        f"trainer.default_local_dir={tmp_path}", "trainer.logger=[jsonl,mlflow]", "trainer.save_freq=-1",
        "trainer.total_training_steps=1", "trainer.test_freq=-1", "trainer.project_name=proj",
        "trainer.experiment_name=exp", "actor_rollout_ref.rollout.trace.backend=mlflow"])
    assert PPODriver(cfg).fit() == 0
    store = f"sqlite:///{tmp_path.resolve() / 'mlruns.db'}"
    client = mlflow.MlflowClient(tracking_uri=store)
    experiment = client.get_experiment_by_name("proj").experiment_id
    (run,) = client.search_runs([experiment])
    (row,) = read_jsonl(tmp_path / "metrics.jsonl")
    assert run.info.run_name == "exp" and run.data.metrics["actor/pg_loss"] == pytest.approx(row["actor/pg_loss"])
    mlflow.set_tracking_uri(store)
    traces = mlflow.search_traces(locations=[experiment], return_type="list")
    assert len(traces) == 8  # 4 prompts x 2 samples, each its own trajectory
    assert {t.info.tags["step"] for t in traces} == {"1"}
    assert all(sorted(s.name for s in t.data.spans) == ["agent_loop", "generate"] for t in traces)
    assert list(elsewhere.iterdir()) == [] and (tmp_path / "mlartifacts").is_dir()


@pytest.mark.slow
@pytest.mark.vllm
def test_two_server_mode_replicas_share_each_batch_and_its_rows_line_up(assets: Path, tmp_path: Path,
                                                                       monkeypatch) -> None:
    """Two Ray ranks, a server-mode replica each: every rollout's trajectories are dealt out to
    both in turn (:func:`trainer.stages.rollout.deal`: a prompt's two samples on two replicas),
    and the rows come back in the batch's order: vLLM's log-probs of each row equal the actor's
    recomputation of that row (a row paired with another's log-probs would differ by far more)."""
    import ray

    from tests.trainer.rollout.vllm_support import require_vllm
    from tests.trainer.test_distributed import no_ray_address

    require_vllm()
    no_ray_address(monkeypatch)
    cfg = load_config(interaction_run_overrides(
        assets, tmp_path, "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.mode=async",
        "trainer.n_gpus_per_node=2"))
    try:
        driver = PPODriver(cfg)
        assert driver.stages.rollout.dealt
        assert driver.fit() == 0
    finally:
        ray.shutdown()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["num_turns/max"] > 2, row
        assert row["dp/rank_0/gen_rows"] == row["dp/rank_1/gen_rows"] == 2, row  # 8 trajectories, 4 each
        assert row["dp/rank_0/gen_tokens"] > 0 and row["dp/rank_1/gen_tokens"] > 0, row
        assert row["training/rollout_probs_diff_max"] < 1e-3, row
