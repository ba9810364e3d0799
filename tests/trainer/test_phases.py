"""Offload as phases and the memory order around the weight sync (`trainer.phases`).

The device-memory API is the one seam (a recording :class:`DeviceMemory`); the moves of the
parameters and the optimizer state run for real on CPU tensors, and the worker, its rollout copy
and the weight sync are the real ones."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from trainer.config import load_config
from trainer.phases import GIB, DeviceMemory, Move, Phases


class RecordingMemory(DeviceMemory):
    """The device-memory API of the CPU, every call written to `log`; peaks read from `peaks`."""

    def __init__(self, log: list[Any], peaks: list[tuple[int, int]] | None = None) -> None:
        super().__init__(torch.device("cpu"))
        self.log, self.peaks = log, list(peaks or [])
        self.current = (0, 0)

    def empty_cache(self) -> None:
        self.log.append("empty_cache")
        super().empty_cache()

    def reset_peak(self) -> None:
        self.current = self.peaks.pop(0) if self.peaks else (0, 0)

    def max_allocated(self) -> int:
        return self.current[0]

    def max_reserved(self) -> int:
        return self.current[1]


def _model_and_optim() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model: torch.nn.Module, optim: torch.optim.Optimizer, phases: Phases, steps: int, minis: int) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        with phases.on_device("old_log_prob", model), torch.no_grad():
            model(torch.randn(2, 4, generator=g))
        with phases.on_device("update_actor", model, optim):
            for _ in range(minis):
                model(torch.randn(3, 4, generator=g)).pow(2).mean().backward()
                phases.require_resident(model, "clip_grad_norm_")
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optim.step()
                optim.zero_grad(set_to_none=True)


def test_offload_moves_once_per_phase_and_trains_as_without() -> None:
    """Parameters come in for each phase and leave after it; the optimizer state comes in for
    the update and leaves after it, once per step however many mini-batches; the weights are
    those of a run without offload."""
    model, optim = _model_and_optim()
    phases = Phases(torch.device("cpu"), offload_optimizer=True, memory=RecordingMemory([]))
    phases.register(model, offload_params=True)
    phases.home(model, optim)
    _train(model, optim, phases, steps=2, minis=3)
    step = [Move("old_log_prob", "params", "device"), Move("old_log_prob", "params", "host"),
            Move("update_actor", "params", "device"), Move("update_actor", "params", "host"),
            Move("update_actor", "optimizer", "host")]
    second = step[:3] + [Move("update_actor", "optimizer", "device")] + step[3:]
    assert phases.moves == [Move("build", "params", "host"), *step, *second]

    plain, plain_optim = _model_and_optim()
    resident = Phases(torch.device("cpu"), offload_optimizer=False)
    resident.register(plain, offload_params=False)
    _train(plain, plain_optim, resident, steps=2, minis=3)
    assert resident.moves == []
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert all(v.device.type == "cpu" for s in optim.state.values() for v in s.values())


def test_a_collective_outside_its_phase_is_refused() -> None:
    model, optim = _model_and_optim()
    phases = Phases(torch.device("cpu"), offload_optimizer=False)
    phases.register(model, offload_params=True)
    phases.home(model, optim)
    with pytest.raises(RuntimeError, match=r"the weight sync needs the parameters on `cpu`.*offloaded to the host"):
        phases.require_resident(model, "the weight sync")
    with phases.on_device("weight_sync", model):
        phases.require_resident(model, "the weight sync")
    stray = torch.nn.Linear(2, 2, device="meta")  # a parameter left off the compute device
    with pytest.raises(RuntimeError, match=r"parameter `weight` is on `meta`, not on the compute device `cpu`"):
        phases.require_resident(stray, "clip_grad_norm_")


def test_phase_peaks_are_reported_in_verl_names() -> None:
    model, _ = _model_and_optim()
    memory = RecordingMemory([], peaks=[(1 * GIB, 2 * GIB), (3 * GIB, 4 * GIB)])
    phases = Phases(torch.device("cpu"), offload_optimizer=False, memory=memory)
    phases.register(model, offload_params=False)
    with phases.on_device("update_actor", model):
        pass
    with phases.on_device("weight_sync", model):
        pass
    assert phases.metrics() == {
        "perf/memory/update_actor/max_allocated_gb": 1.0, "perf/memory/update_actor/max_reserved_gb": 2.0,
        "perf/memory/weight_sync/max_allocated_gb": 3.0, "perf/memory/weight_sync/max_reserved_gb": 4.0,
        "perf/max_memory_allocated_gb": 3.0, "perf/max_memory_reserved_gb": 4.0}
    assert phases.metrics() == {"perf/max_memory_allocated_gb": 0.0, "perf/max_memory_reserved_gb": 0.0}


class Spy:
    """The real rollout engine, its sleep and wake-ups written to `log` as they are called."""

    def __init__(self, engine: Any, log: list[Any]) -> None:
        self.engine, self.log = engine, log

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.log.append(f"wake_up:{','.join(tags) if tags else 'all'}")
        self.engine.wake_up(tags)

    def sleep(self) -> None:
        self.log.append("sleep")
        self.engine.sleep()


def test_the_worker_syncs_and_rolls_out_in_verls_memory_order(tiny_model_dir: Path) -> None:
    """The weight sync: empty the cache, wake the weights, bring the parameters in, stream,
    send them home, empty the cache, then wake the KV cache. After the rollout: sleep, then
    empty the cache. The rollout copy then holds the actor's weights."""
    from trainer.rollout.base import SamplingParams
    from trainer.rollout.hf import HFRolloutEngine, rollout_copy
    from trainer.workers.actor import ActorRolloutRefWorker

    cfg = load_config([f"actor_rollout_ref.model.path={tiny_model_dir}", "data.max_response_length=4",
                       "actor_rollout_ref.actor.fsdp_config.param_offload=true",
                       "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true"])
    worker = ActorRolloutRefWorker(cfg, 0, 1, total_steps=1)
    worker.init_dist(None, None)
    log: list[Any] = []
    worker.phases.memory = RecordingMemory(log)
    worker.phases.moves = log
    # one rank generates with the actor itself; two or more (FSDP) keep a rollout copy: that one
    copy = rollout_copy(str(tiny_model_dir), 1, 1, worker.device)
    with torch.no_grad():
        for p in copy.parameters():
            p.zero_()
    engine = HFRolloutEngine(copy, worker.tokenizer.pad_token_id, worker.tokenizer.eos_token_id, offload=True)
    worker.rollout, worker.shares_weights = Spy(engine, log), False

    worker.sync_rollout_weights()
    assert log == ["empty_cache", "wake_up:weights", Move("weight_sync", "params", "device"),
                   Move("weight_sync", "params", "host"), "empty_cache", "empty_cache", "wake_up:kv_cache"]
    actor = worker.model.state_dict()
    for name, value in copy.state_dict().items():
        torch.testing.assert_close(value, actor[name], rtol=0, atol=0, msg=name)

    log.clear()
    prompts = torch.tensor([[1, 2, 3]])
    out, _ = worker.generate(prompts, torch.ones_like(prompts), SamplingParams(n=1, max_response_length=2), seed=0)
    assert out is not None and log == ["wake_up:all", "sleep", "empty_cache"]
    metrics = worker.memory_metrics()
    assert {"perf/max_memory_allocated_gb", "perf/max_memory_reserved_gb",
            "perf/memory/weight_sync/max_allocated_gb", "perf/memory/rollout/max_reserved_gb"} <= set(metrics)


def test_an_engine_that_discarded_its_weights_is_synced_before_the_next_rollout(tiny_model_dir: Path) -> None:
    """vLLM's level-2 sleep discards the weights: a rollout with no update (and so no weight
    sync) behind it, such as a `critic_warmup` step, validation or the rollout after a checkpoint,
    gets the actor's weights again first, and generates what the first rollout generated."""
    from trainer.rollout.base import SamplingParams
    from trainer.rollout.hf import HFRolloutEngine, rollout_copy
    from trainer.workers.actor import ActorRolloutRefWorker

    class Discarding(HFRolloutEngine):
        """HF generate whose sleep loses the weights, as vLLM's level 2 does."""

        def sleep(self) -> None:
            with torch.no_grad():
                for p in self.model.parameters():
                    p.zero_()
            self.needs_sync = True

        def sync_weights(self, buckets: Any) -> None:
            super().sync_weights(buckets)
            self.needs_sync = False

    cfg = load_config([f"actor_rollout_ref.model.path={tiny_model_dir}", "data.max_response_length=4"])
    worker = ActorRolloutRefWorker(cfg, 0, 1, total_steps=1)
    worker.init_dist(None, None)
    log: list[Any] = []
    worker.phases.memory = RecordingMemory(log)
    engine = Discarding(rollout_copy(str(tiny_model_dir), 1, 1, worker.device), worker.tokenizer.pad_token_id,
                        worker.tokenizer.eos_token_id)
    worker.rollout, worker.shares_weights = Spy(engine, log), False
    worker.sync_rollout_weights()
    prompts = torch.tensor([[1, 2, 3]])
    greedy = SamplingParams(n=1, max_response_length=4, do_sample=False)
    first, _ = worker.generate(prompts, torch.ones_like(prompts), greedy, seed=0)
    log.clear()
    second, _ = worker.generate(prompts, torch.ones_like(prompts), greedy, seed=0)
    assert log[:2] == ["empty_cache", "wake_up:weights"] and "wake_up:all" in log  # synced, then rolled out
    assert first is not None and second is not None
    torch.testing.assert_close(second.response_ids, first.response_ids, rtol=0, atol=0)


@pytest.mark.parametrize("hf_model", [False, True])
def test_a_checkpoint_is_taken_with_the_engine_asleep_and_exports_weights_only_with_hf_model(
        tiny_model_dir: Path, tmp_path: Path, hf_model: bool) -> None:
    """The engine is awake after the weight sync (vLLM: its KV cache); the save first sleeps it,
    then brings the offloaded state in. `huggingface/` holds the config and tokenizer, and the
    weights only with `hf_model` in `actor.checkpoint.save_contents` (verl's rule); the rollout
    after the checkpoint generates with the actor's weights again."""
    from trainer.rollout.base import SamplingParams
    from trainer.rollout.hf import HFRolloutEngine, rollout_copy
    from trainer.workers.actor import ActorRolloutRefWorker

    contents = "[model,optimizer,extra,hf_model]" if hf_model else "[model,optimizer,extra]"
    cfg = load_config([f"actor_rollout_ref.model.path={tiny_model_dir}", "data.max_response_length=4",
                       "actor_rollout_ref.actor.fsdp_config.param_offload=true",
                       f"actor_rollout_ref.actor.checkpoint.save_contents={contents}"])
    worker = ActorRolloutRefWorker(cfg, 0, 1, total_steps=1)
    worker.init_dist(None, None)
    log: list[Any] = []
    worker.phases.memory = RecordingMemory(log)
    worker.phases.moves = log
    engine = HFRolloutEngine(rollout_copy(str(tiny_model_dir), 1, 1, worker.device), worker.tokenizer.pad_token_id,
                             worker.tokenizer.eos_token_id, offload=True)
    worker.rollout, worker.shares_weights = Spy(engine, log), False
    worker.sync_rollout_weights()
    log.clear()
    worker.save_checkpoint(str(tmp_path))
    assert log.index("sleep") < log.index(Move("checkpoint", "params", "device")), log
    hf = tmp_path / "huggingface"
    assert (hf / "config.json").is_file() and (hf / "tokenizer_config.json").is_file()
    assert [f.name for f in hf.glob("*.safetensors")] == (["model.safetensors"] if hf_model else [])
    prompts = torch.tensor([[1, 2, 3]])
    log.clear()
    out, _ = worker.generate(prompts, torch.ones_like(prompts), SamplingParams(n=1, max_response_length=2), seed=0)
    assert out is not None and log[0] == "wake_up:all"


def test_checkpoint_contents_are_verls_parts_and_partial_ones_are_refused() -> None:
    from trainer.config import ConfigError

    key = "actor_rollout_ref.actor.checkpoint"
    assert load_config().actor_rollout_ref.actor.checkpoint.save_contents == ["model", "optimizer", "extra"]
    assert "hf_model" in load_config([f"{key}.save_contents=[model,optimizer,extra,hf_model]",
                                      f"{key}.load_contents=[model,optimizer,extra]"]
                                     ).actor_rollout_ref.actor.checkpoint.save_contents
    with pytest.raises(ConfigError, match=r"save_contents=\['model'\]` leaves out \['optimizer', 'extra'\]: "
                                          r"partial checkpoints .* Fix: keep `model`, `optimizer` and `extra`"):
        load_config([f"{key}.save_contents=[model]"])
    with pytest.raises(ConfigError, match=r"load_contents` names \['weights'\]; the parts are"):
        load_config([f"{key}.load_contents=[model,optimizer,extra,weights]"])
