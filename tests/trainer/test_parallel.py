"""Data parallelism without Ray: the real workers in 1 and 2 processes over gloo give the same
weights after one update (fixed and token-budget micro-batches, actor with a KL loss, critic),
and the pure pieces (row splits, balanced micro-batches, IPv6 URLs) behave."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from trainer import parallel as P
from trainer.batch import MiniBatchShare, StepBatch
from trainer.config import load_config


def test_split_rows() -> None:
    assert P.split_rows(5, 2) == [[0, 1, 2], [3, 4]]
    assert P.split_rows(2, 3) == [[0], [1], []]


def test_workload_is_verls_flops_proxy() -> None:
    assert P.workload([0, 1, 10]) == [0, 24577, 245860]  # 24576 n + n^2


def test_largest_differencing_equal_size_by_hand() -> None:
    """Values 1..8 into 2 groups of 4. Pairs in sorted order start the states, each with spread
    1: {2|1} {4|3} {6|5} {8|7}. Ties go to the larger largest set: {8|7} merges with {6|5}
    (8+5, 7+6: 13|13), then {4|3} with {2|1} (4+1, 3+2: 5|5); last 13|13 with 5|5, each
    largest with the other's smallest: (8,5)+(3,2), (7,6)+(4,1); equal sums and sizes, the set
    holding row 7 first."""
    assert P.karmarkar_karp([1, 2, 3, 4, 5, 6, 7, 8], 2, equal_size=True) == [[1, 2, 4, 7], [0, 3, 5, 6]]
    with pytest.raises(ValueError, match="7 rows do not split into 2 groups of equal size"):
        P.karmarkar_karp([1] * 7, 2, equal_size=True)
    with pytest.raises(ValueError, match="cannot split 2 rows into 3"):
        P.karmarkar_karp([1, 1], 3, equal_size=False)


def test_balanced_split_is_verls_balance_batch_by_hand() -> None:
    """Lengths 1..8 over 2 ranks, by workload w(n) = 24576 n + n^2 (monotone in n). Spreads of
    the starting pairs: w(2)-w(1) = 24579 < w(4)-w(3) = 24583 < 24587 < w(8)-w(7) = 24591, so
    {8|7} merges with {6|5} first (w8+w5 vs w7+w6: 24576*13 + 89 | + 85), then {4|3} with {2|1}
    (+17 | +13), then (8,5)+(3,2) and (7,6)+(4,1): 24576*18 + 102 each, the set holding row 7
    first. Each rank's rows lightest first, then every other one back: sorted [1,2,4,7] ->
    [1,4] + [7,2]; [0,3,5,6] -> [0,5] + [6,3]."""
    assert P.balanced_split([1, 2, 3, 4, 5, 6, 7, 8], 2) == [[1, 4, 7, 2], [0, 5, 6, 3]]
    lengths = [9, 1, 1, 8, 2, 3, 7, 5, 4, 4, 6, 2]
    groups = P.balanced_split(lengths, 3)
    assert [len(g) for g in groups] == [4, 4, 4]
    assert sorted(r for g in groups for r in g) == list(range(12))
    assert P.balanced_split([1] * 7, 3) == [[0, 1, 2], [3, 4], [5, 6]]  # no equal split: contiguous


def test_mini_batches_are_cut_from_each_rank_s_rows() -> None:
    """verl splits over the ranks first, then each rank cuts consecutive local mini-batches:
    8 rows, 2 ranks, mini-batches of 4 (2 per rank). Mini-batch 0 is rows 1,4 of rank 0 and 0,5
    of rank 1 (not rows 0-3 of the batch)."""
    per_rank = P.balanced_split([1, 2, 3, 4, 5, 6, 7, 8], 2)
    assert P.rank_mini_batches(per_rank, 2) == [[[1, 4], [0, 5]], [[7, 2], [6, 3]]]
    assert P.rank_mini_batches([[0, 1, 2], [3, 4, 5]], 2) == [[[0, 1], [3, 4]], [[2], [5]]]


def test_dynamic_micro_batches_are_verls_by_hand() -> None:
    """Lengths 4,4,3,9,1 with 8 tokens per micro-batch: ceil(21 / 8) = 3 micro-batches.
    Workloads w(9) = 221265 > w(4) = 98320 (rows 0, 1) > w(3) = 73737 > w(1) = 24577; every row
    starts alone. Largest spreads first: {9} with {4 (row 1)}: {9|4|}; then with {4 (row 0)}:
    {9|4|4}, spread w9-w4; then row 2 joins the smallest set's opposite: {9|4,3|4}; then row 4:
    {9 | 4,3 | 4,1}. Heaviest first: [3], [0,2], [1,4]; dealt to both ends:
    [::2][::-1] + [1::2] = [1,4], [3], [0,2]."""
    assert P.rank_micro_batches([4, 4, 3, 9, 1], None, True, 8) == [[1, 4], [3], [0, 2]]
    assert P.rank_micro_batches([4, 4, 3], 2, False, 0) == [[0, 1], [2]]
    assert P.rank_micro_batches([4, 4, 3], None, True, 100) == [[0, 1, 2]]


def test_init_method_brackets_ipv6() -> None:
    assert P.init_method_url("10.0.0.1", 5) == "tcp://10.0.0.1:5"
    assert P.init_method_url("fd77::11", 5) == "tcp://[fd77::11]:5"
    assert P.init_method_url("[fd77::11]", 5) == "tcp://[fd77::11]:5"


def _batch(rows: int, seed: int) -> StepBatch:
    g = torch.Generator().manual_seed(seed)
    prompt, resp = 6, 8
    ids = torch.randint(7, 40, (rows, prompt + resp), generator=g)
    mask = torch.ones(rows, prompt + resp, dtype=torch.long)
    mask[:, : int(torch.randint(0, 3, (1,), generator=g))] = 0
    lengths = torch.randint(1, resp + 1, (rows,), generator=g)
    response_mask = (torch.arange(resp)[None, :] < lengths[:, None]).float()
    mask[:, prompt:] = response_mask.long()
    token = torch.randn(rows, resp, generator=g) * response_mask
    return StepBatch(examples=[], uids=[], input_ids=ids, attention_mask=mask, response_mask=response_mask,
                     old_log_probs=-torch.rand(rows, resp, generator=g) * 3,
                     ref_log_probs=-torch.rand(rows, resp, generator=g) * 3,
                     advantages=token, values=token * 0.5, returns=token * 0.3)


VARIANTS = {
    # verl's default worker: micro-batch means; two rows per micro-batch on one rank, or two
    # ranks of two rows, average the same two means
    "micro": ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"],
    # verl's model engine: the actor divides by the whole mini-batch, whatever the split (its
    # critic sums micro-batch means, which depend on the split: not compared)
    "dynamic": ["actor_rollout_ref.actor.use_dynamic_bsz=true", "trainer.use_legacy_worker_impl=disable",
                "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=30"],
    # the micro variant with offload: parameters and Adam state moved per phase (trainer.phases)
    "offload": ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                "actor_rollout_ref.actor.fsdp_config.param_offload=true",
                "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
                "critic.model.fsdp_config.param_offload=true", "critic.model.fsdp_config.optimizer_offload=true"],
    # verl's mixed precision on packed sequences: FSDP2's bf16 policy on two ranks, autocast on one
    "bf16": ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
             "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16",
             "critic.model.fsdp_config.mixed_precision.param_dtype=bf16",
             "actor_rollout_ref.model.use_remove_padding=true", "critic.model.use_remove_padding=true"],
}
#: bf16 rounds differently under FSDP2's parameter cast and under autocast: losses and gradient
#: norms agree to bf16 precision; weights after Adam's sign-like first steps are not compared.
BF16_TOL = {"rtol": 3e-2, "atol": 1e-3}


def _overrides(model: str, world: int, variant: str) -> list[str]:
    return [f"actor_rollout_ref.model.path={model}", f"trainer.n_gpus_per_node={world}",
            "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.optim.lr=1e-3",
            "critic.optim.lr=1e-3", "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
            "data.max_response_length=8", *VARIANTS[variant]]


def _rank_main(rank: int, world: int, port: int, model: str, out: str) -> None:
    from trainer.algos.core_algos import loss_normalizers
    from trainer.workers.actor import ActorRolloutRefWorker
    from trainer.workers.critic import CriticWorker

    torch.set_num_threads(1)
    results = {}
    minis = [_batch(4, 1), _batch(4, 2)]  # two mini-batches of 4 samples: two optimizer steps
    mine = [MiniBatchShare(m.select(P.split_rows(len(m), world)[rank]), *loss_normalizers(m.response_mask))
            for m in minis]
    for variant in VARIANTS:
        cfg = load_config(_overrides(model, world, variant))
        actor = ActorRolloutRefWorker(cfg, rank, world, total_steps=3)
        actor.init_dist("127.0.0.1", port)
        if variant == "micro":  # built empty and sharded, each rank reading only its shards
            results["built"] = {k: v.clone() for k, v in actor.state_for_test().items()}  # one rank: live
        metrics = actor.update_actor([mine])["metrics"]
        results[f"actor-{variant}"] = actor.state_for_test()
        results[f"moves-{variant}"] = {f"{m.phase} {m.what} {m.to}": torch.tensor(i)
                                       for i, m in enumerate(actor.phases.moves)}
        critic = CriticWorker(cfg, rank, world, total_steps=3)
        critic.init_dist("127.0.0.1", port)
        metrics.update(critic.update_critic([mine])["metrics"])
        results[f"critic-{variant}"] = P.full_model_state(critic.model)
        # losses: this rank's share; their mean over ranks is the whole batch's loss
        results[f"metrics-{variant}"] = {k: torch.tensor(v) for k, v in metrics.items()}
    torch.save(results, f"{out}.{rank}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(world: int, model: Path, out: Path) -> mp.ProcessContext:
    ctx = mp.start_processes(_rank_main, args=(world, _free_port(), str(model), str(out)), nprocs=world,
                             join=False, start_method="spawn")
    assert ctx is not None
    return ctx


def _finish(ctx: mp.ProcessContext, world: int, out: Path) -> dict[str, dict[str, torch.Tensor]]:
    while not ctx.join():
        pass
    ranks = [torch.load(f"{out}.{r}") for r in range(world)]
    merged = ranks[0]
    for name in merged:  # metrics: the mean over ranks is the whole batch's value
        if name.startswith("moves"):
            assert all(r[name] == merged[name] for r in ranks), name
        if name.startswith("metrics"):
            merged[name] = {k: sum(r[name][k] for r in ranks) / world for k in merged[name]}
    return merged


COMPARED = {"actor/grad_norm", "actor/pg_loss", "actor/kl_loss", "actor/lr", "critic/vf_loss",
            "critic/grad_norm"}


def _grad_rank_main(rank: int, world: int, port: int, model: str, out: str) -> None:
    """One actor update of one mini-batch of 4 rows on `world` ranks with micro-batches of one
    row, under verl's default worker and under its model engine, for two epochs; the averaged
    gradient each rank holds before the first optimizer step, gathered whole, and `actor/pg_loss`."""
    from trainer.algos.core_algos import loss_normalizers
    from trainer.workers.actor import ActorRolloutRefWorker

    torch.set_num_threads(1)
    mini = _batch(4, 3)
    mini.old_log_probs = None  # on-policy: ratio 1, nothing clipped, d(pg loss)/d logp = -A
    share = MiniBatchShare(mini.select(P.split_rows(4, world)[rank]), *loss_normalizers(mini.response_mask))
    grads: dict[str, dict[str, torch.Tensor]] = {}
    for impl in ("auto", "disable"):
        cfg = load_config([f"actor_rollout_ref.model.path={model}", f"trainer.n_gpus_per_node={world}",
                           "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
                           "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
                           "actor_rollout_ref.actor.loss_agg_mode=token-mean", "data.max_response_length=8",
                           f"trainer.use_legacy_worker_impl={impl}"])
        actor = ActorRolloutRefWorker(cfg, rank, world, total_steps=1)
        actor.init_dist("127.0.0.1", port)
        step = actor._optimizer_step

        def capture(clip: float, actor: ActorRolloutRefWorker = actor, impl: str = impl,
                    step=step) -> float:  # noqa: ANN001
            grads.setdefault(impl, {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                                    for n, p in actor.model.named_parameters() if p.grad is not None})
            return float(step(clip))

        actor._optimizer_step = capture  # type: ignore[method-assign]
        metrics = actor.update_actor([[share], [share]])["metrics"]  # two epochs; the first step's gradient kept
        grads[f"pg_loss-{impl}"] = {"value": torch.tensor(metrics["actor/pg_loss"])}
    torch.save(grads, f"{out}.{rank}")


def _reference_grads(model_dir: Path, parts: list[list[list[int]]], scales: list[float]
                     ) -> dict[str, torch.Tensor]:
    """The gradient of `sum over ranks r and micro-batches j of scales[r] * (-sum_t A_t logp_t / T_j)`
    on a plain, unsharded model: verl's formula written out, with `T_j` the micro-batch's tokens."""
    from trainer.models import compute_log_probs, load_actor

    model = load_actor(str(model_dir)).float()
    model.train()
    mini = _batch(4, 3)
    for rank_parts, scale in zip(parts, scales, strict=True):
        for rows in rank_parts:
            mb = mini.select(rows)
            logp, _ = compute_log_probs(model, mb.input_ids, mb.attention_mask, mb.response_length)
            assert mb.advantages is not None
            loss = -(mb.advantages * logp * mb.response_mask).sum() / mb.response_mask.sum()
            (scale * loss).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_two_ranks_with_gradient_accumulation_give_verls_gradients(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Two ranks of two rows, micro-batches of one row (gradient accumulation 2). verl's default
    worker: each micro-batch's token mean times 1/2, the ranks averaged (1/2 again). verl's model
    engine: every token over the mini-batch's tokens. The two differ, each equals its formula."""
    ctx = mp.start_processes(_grad_rank_main, args=(2, _free_port(), str(tiny_model_dir), str(tmp_path / "g")),
                             nprocs=2, join=False, start_method="spawn")
    while not ctx.join():
        pass
    got = torch.load(f"{tmp_path / 'g'}.0")
    other = torch.load(f"{tmp_path / 'g'}.1")
    legacy = _reference_grads(tiny_model_dir, [[[0], [1]], [[2], [3]]], [0.25, 0.25])
    mask = _batch(4, 3).response_mask
    engine = {n: torch.zeros_like(g) for n, g in legacy.items()}
    for r in range(4):  # -sum A logp / all tokens = sum over rows of (row's token mean * row tokens / all)
        row = _reference_grads(tiny_model_dir, [[[r]]], [float(mask[r].sum() / mask.sum())])
        engine = {n: engine[n] + row[n] for n in engine}
    for impl, expected in (("auto", legacy), ("disable", engine)):
        assert set(got[impl]) == set(expected)
        for name, grad in expected.items():
            torch.testing.assert_close(got[impl][name], grad, rtol=1e-4, atol=1e-6, msg=f"{impl} {name}")
    assert any(not torch.allclose(legacy[n], engine[n], rtol=1e-3, atol=1e-6) for n in legacy)
    # actor/pg_loss as verl: micro-batch losses times their scale, summed over micro-batches and
    # the two epochs, averaged over ranks. On-policy each token's loss is -A.
    adv = _batch(4, 3).advantages
    assert adv is not None
    row_means = [float(-(adv[r] * mask[r]).sum() / mask[r].sum()) for r in range(4)]
    whole = float(-(adv * mask).sum() / mask.sum())
    for impl, expected_loss in (("auto", 2 * 0.25 * sum(row_means)), ("disable", 2 * whole)):
        mean = (got[f"pg_loss-{impl}"]["value"] + other[f"pg_loss-{impl}"]["value"]) / 2
        assert mean.tolist() == pytest.approx([expected_loss], rel=1e-5), impl


def test_one_update_on_one_and_two_ranks_gives_the_same_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Weights after two optimizer steps agree to float noise (Adam magnifies the noise of
    near-zero gradients); losses and gradient norms, which Adam's scale invariance would hide
    in the weights, agree closely too."""
    from transformers import AutoModelForCausalLM

    started = [_start(1, tiny_model_dir, tmp_path / "one"), _start(2, tiny_model_dir, tmp_path / "two")]
    one = _finish(started[0], 1, tmp_path / "one")
    two = _finish(started[1], 2, tmp_path / "two")
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    for result in (one, two):  # what the ranks read of the checkpoint is the whole model
        assert set(result["built"]) == set(start)
        for key, value in start.items():
            torch.testing.assert_close(result["built"][key], value, rtol=0, atol=0, msg=key)
    for name, weights in one.items():
        if name == "critic-dynamic":
            continue
        if name.startswith("actor"):
            moved = max((weights[k] - start[k]).abs().max().item() for k in start)
            assert moved > 5e-4, f"{name}: the update did not change the weights"
        tol = {"rtol": 1e-4, "atol": 1e-6} if name.startswith("metrics") else {"rtol": 0, "atol": 1e-5}
        assert set(two[name]) == set(weights), name
        if name.endswith("bf16"):
            assert all(t.dtype == torch.float32 for t in two[name].values()), "fp32 master weights"
            if not name.startswith("metrics"):
                continue
            tol = BF16_TOL
        for key, value in weights.items():
            if name.startswith("metrics") and (key not in COMPARED or (key.startswith("critic")
                                                                       and name.endswith("dynamic"))):
                continue  # per-micro-batch statistics (clip fractions) depend on the split
            torch.testing.assert_close(two[name][key], value, **tol, msg=f"{name} {key}")
    assert COMPARED <= set(one["metrics-dynamic"])
    for result in (one, two):  # offload moves the state between phases and changes no number
        for key, value in result["actor-micro"].items():
            torch.testing.assert_close(result["actor-offload"][key], value, rtol=0, atol=0, msg=key)
        # the parameters go home after the build, come in for the update with the Adam state
        # (created there), and everything goes home once after the two optimizer steps; then
        # once more around the gathering of the test's state
        assert list(result["moves-offload"]) == [
            "build params host", "update_actor params device", "update_actor params host",
            "update_actor optimizer host", "checkpoint params device", "checkpoint params host"]
        assert result["moves-micro"] == {}


def test_trainer_distributed_switch_and_vllm_tensor_parallel_check() -> None:
    from trainer.config import ConfigError
    from trainer.workers.start import use_ray

    assert not use_ray(load_config([]))
    assert use_ray(load_config(["trainer.nnodes=2"]))
    assert use_ray(load_config(["trainer.distributed=true"]))
    assert not use_ray(load_config(["trainer.nnodes=2", "trainer.distributed=false"]))
    with pytest.raises(ConfigError, match="must divide the 1 ranks"):  # one rank cannot hold a TP=2 engine
        load_config(["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"])
    with pytest.raises(ConfigError, match="must divide the 6 ranks"):
        load_config(["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=4",
                     "actor_rollout_ref.actor.ppo_mini_batch_size=48", "data.train_batch_size=96",
                     "trainer.nnodes=3", "trainer.n_gpus_per_node=2"])
    assert load_config(["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                        "trainer.nnodes=2", "trainer.n_gpus_per_node=2"]).actor_rollout_ref.rollout.tensor_model_parallel_size == 2


def test_the_store_reach_is_as_stated() -> None:
    """`trainer.parallel`'s statement, measured: rank 0's store listens on every interface
    whatever host it is given, and a process of another user reads its keys. If torch ever
    binds it to the host, or authenticates, this fails and the statement must change."""
    import datetime
    import os
    import subprocess
    import sys

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=30))
    store.set("rendezvous", "secret-of-the-group")
    listening = subprocess.run(["ss", "-Hltn"], capture_output=True, text=True).stdout.split()[3::5]
    assert f"*:{store.port}" in listening or f"0.0.0.0:{store.port}" in listening, listening
    code = ("import datetime, torch.distributed as d\n"
            f"s = d.TCPStore('127.0.0.1', {store.port}, is_master=False, "
            "timeout=datetime.timedelta(seconds=30))\n"
            "print(sorted(s.list_keys()), s.get('rendezvous').decode())\n")
    env = {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p.endswith("site-packages")),
           "PATH": "/usr/bin:/bin"}
    # another user (as root: `nobody`) with the system's Python and this venv's packages, where
    # `nobody` may read them (a checkout under a private directory, as a fresh clone in a
    # `mkdtemp` is, keeps them out of its reach): the connection carries no credential, so any
    # process that reaches the port reads the keys, whoever runs it
    as_other: dict[str, int] = {}
    if os.getuid() == 0 and os.access("/usr/bin/python3", os.X_OK):
        probe = subprocess.run(["/usr/bin/python3", "-c", "import torch.distributed"], env=env,
                               capture_output=True, timeout=120, user=65534, group=65534)
        as_other = {"user": 65534, "group": 65534} if probe.returncode == 0 else {}
    python = "/usr/bin/python3" if as_other else sys.executable
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120,
                         env=env, **as_other)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "secret-of-the-group" in out.stdout and "rendezvous" in out.stdout
