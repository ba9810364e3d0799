"""Atomic checkpoint directories: round trips, pruning, HF export, and writers killed mid-way."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from tests.trainer.ranks import leave_rank
from trainer.checkpoint import full_state as ck

REPO = Path(__file__).resolve().parents[2]


def small_states(step: int) -> dict[str, object]:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return {
        "actor": model.state_dict(),
        "actor_optim": opt.state_dict(),
        "trainer_state": {"global_step": step, "dataloader": {"epoch": 0, "index": 7}},
    }


def test_round_trip_marker_and_manifest(tmp_path: Path) -> None:
    states = small_states(3)
    path = ck.save_checkpoint(
        tmp_path, 3, states, files={"config.yaml": "a: 1\n"}, metadata={"note": "x"}
    )
    assert path == tmp_path / "global_step_3" and ck.is_complete(path)
    assert ck.read_latest_marker(tmp_path) == 3
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "3\n"
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["step"] == 3 and manifest["metadata"] == {"note": "x"}
    assert set(manifest["files"]) == {
        "actor.pt",
        "actor_optim.pt",
        "trainer_state.pt",
        "config.yaml",
    }
    loaded = ck.load_checkpoint(path)
    assert set(loaded) == {"actor", "actor_optim", "trainer_state"}
    torch.testing.assert_close(loaded["actor"], states["actor"])
    assert loaded["actor_optim"]["state"][0]["step"] == states["actor_optim"]["state"][0]["step"]
    assert ck.load_state(path, "trainer_state")["dataloader"]["index"] == 7
    with pytest.raises(KeyError, match="Available: actor, actor_optim, trainer_state"):
        ck.load_state(path, "critic")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_nested_names_and_bad_names(tmp_path: Path) -> None:
    path = ck.save_checkpoint(tmp_path, 1, {"critic/model": {"w": torch.zeros(2)}})
    assert set(ck.load_checkpoint(path)) == {"critic/model"}
    torch.testing.assert_close(ck.load_state(path, "critic/model")["w"], torch.zeros(2))
    for bad in ("../x", "manifest.json", "a b", ""):
        with pytest.raises(ValueError, match="Invalid checkpoint entry name"):
            ck.save_checkpoint(tmp_path, 2, {bad: 1})
    assert ck.find_latest_checkpoint(tmp_path) == path


def test_keep_last_and_resave(tmp_path: Path) -> None:
    for step in range(1, 6):
        ck.save_checkpoint(tmp_path, step, {"s": step}, keep_last=2)
    assert [ck.step_of(p) for p in ck.list_checkpoints(tmp_path)] == [4, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "global_step_4", "global_step_5", "latest_checkpointed_iteration.txt", "run_id",
    ]  # fmt: skip
    ck.save_checkpoint(tmp_path, 5, {"s": 50})
    assert ck.load_state(tmp_path / "global_step_5", "s") == 50
    assert ck.prune_checkpoints(tmp_path, 0) == []


def test_incomplete_directories_are_never_picked(tmp_path: Path) -> None:
    good = ck.save_checkpoint(tmp_path, 1, {"s": 1})
    # A newer directory without a manifest (e.g. copied by hand or cut short).
    (tmp_path / "global_step_7").mkdir()
    (tmp_path / "global_step_7" / "s.pt").write_bytes(b"junk")
    # A newer one whose file was truncated after the manifest was written.
    bad = ck.save_checkpoint(tmp_path, 9, {"s": torch.zeros(100)})
    with open(bad / "s.pt", "r+b") as f:
        f.truncate(10)
    # A corrupt manifest, and a manifest claiming another step.
    (tmp_path / "global_step_11").mkdir()
    (tmp_path / "global_step_11" / "manifest.json").write_text("{not json")
    (tmp_path / "global_step_12").mkdir()
    (tmp_path / "global_step_12" / "manifest.json").write_text('{"step": 3, "files": {}}')
    assert ck.find_latest_checkpoint(tmp_path) == good
    assert ck.resolve_resume(tmp_path, "auto") == good
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        ck.resolve_resume(tmp_path, "resume_path", tmp_path / "global_step_9")
    with pytest.raises(FileNotFoundError, match="cut short"):
        ck.load_checkpoint(tmp_path / "global_step_7")


def test_renamed_but_marker_not_yet_written_is_complete(tmp_path: Path) -> None:
    ck.save_checkpoint(tmp_path, 1, {"s": 1})
    ck.save_checkpoint(tmp_path, 2, {"s": 2})
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1\n")  # as if killed before
    assert ck.find_latest_checkpoint(tmp_path) == tmp_path / "global_step_2"


def test_resolve_resume_modes(tmp_path: Path) -> None:
    assert ck.resolve_resume(tmp_path / "none", "auto") is None
    p = ck.save_checkpoint(tmp_path, 4, {"s": 4})
    assert ck.resolve_resume(tmp_path, "disable") is None
    assert ck.resolve_resume(tmp_path, "resume_path", p) == p
    with pytest.raises(ValueError, match="resume_from_path"):
        ck.resolve_resume(tmp_path, "resume_path")
    with pytest.raises(ValueError, match="Valid values: auto, disable, resume_path"):
        ck.resolve_resume(tmp_path, "latest")


def _other_run(tmp_path: Path) -> ck.RunIdentity:
    return ck.run_identity(tmp_path / "other-run")


def test_a_run_is_its_run_directory_and_its_id_persists(tmp_path: Path) -> None:
    first = ck.run_identity(tmp_path / "run")
    assert ck.run_identity(tmp_path / "run") == first  # a requeue or --resume of the run
    assert (tmp_path / "run" / "run_id").read_text().strip() == first.run_id
    assert first.run_dir == str(tmp_path / "run")
    assert ck.run_identity(tmp_path / "other").run_id != first.run_id
    (tmp_path / "run" / "run_id").write_text("../../x\n")
    with pytest.raises(ck.CheckpointOwnerError, match=r"holds `\.\./\.\./x`, not a run id.*Fix:"):
        ck.run_identity(tmp_path / "run")


def test_retention_never_deletes_the_checkpoint_just_committed(tmp_path: Path) -> None:
    """The run resumed from an earlier step: its step 200 is older than its step 110."""
    ck.save_checkpoint(tmp_path, 200, {"s": 200})
    kept = ck.save_checkpoint(tmp_path, 110, {"s": 110}, keep_last=1)
    assert ck.read_latest_marker(tmp_path) == 110 and ck.is_complete(kept)
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["global_step_110"]
    assert ck.resolve_resume(tmp_path, "auto") == kept
    manifest = json.loads((kept / "manifest.json").read_text())
    assert manifest["seq"] == 2 and manifest["run"] == {
        "id": ck.run_identity(tmp_path).run_id, "dir": str(tmp_path)}


def test_retention_and_resume_leave_another_runs_checkpoints_alone(tmp_path: Path) -> None:
    other = _other_run(tmp_path)
    theirs = ck.save_checkpoint(tmp_path, 200, {"s": 200}, run=other)
    with pytest.raises(ck.CheckpointOwnerError, match=(
            rf"found no checkpoint of this run `[0-9a-f]{{16}}` .*only other runs': global_step_200 "
            rf"of run `{other.run_id}` \(run directory `{other.run_dir}`\).*Fix: .*"
            rf"trainer.resume_from_path={theirs}")):
        ck.resolve_resume(tmp_path, "auto")
    ours = [ck.save_checkpoint(tmp_path, step, {"s": step}, keep_last=1) for step in (100, 110)]
    assert not ours[0].exists() and ours[1].exists() and theirs.exists()
    assert ck.resolve_resume(tmp_path, "auto") == ours[1]  # not their higher step
    assert ck.resolve_resume(tmp_path, "auto", run=other) == theirs
    with pytest.raises(ck.CheckpointOwnerError, match=rf"`{theirs}` belongs to run `{other.run_id}`"
                       r".*never replaces another run's checkpoint. Fix:"):
        ck.save_checkpoint(tmp_path, 200, {"s": -1})
    assert ck.load_state(theirs, "s") == 200
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    legacy = tmp_path / "global_step_300"  # a manifest without a run: whose is unknown
    legacy.mkdir()
    (legacy / "manifest.json").write_text('{"step": 300, "files": {}}')
    with pytest.raises(ck.CheckpointOwnerError, match="global_step_300 of an unknown run"):
        ck.resolve_resume(tmp_path, "auto", run=ck.run_identity(tmp_path / "third"))


def test_only_this_runs_temporaries_are_removed(tmp_path: Path) -> None:
    other = _other_run(tmp_path)
    theirs = ck.begin_checkpoint(tmp_path, 5, run=other)  # another writer, still writing
    (theirs / "s.pt").write_bytes(b"half")
    unknown = tmp_path / ".tmp-global_step_5-123-abcd"  # named before run ids: whose is unknown
    unknown.mkdir()
    ours = ck.begin_checkpoint(tmp_path, 5)  # this run's writer, killed
    ck.save_checkpoint(tmp_path, 6, {"s": 6})
    assert theirs.is_dir() and (theirs / "s.pt").read_bytes() == b"half" and unknown.is_dir()
    assert not ours.exists()


def test_checkpoints_writable_by_others_are_refused_and_saves_are_not(
        tmp_path: Path) -> None:
    old = os.umask(0o002)  # a site whose users share a group-writable default
    try:
        path = ck.save_checkpoint(tmp_path / "root", 1, {"s": torch.ones(2)})
    finally:
        os.umask(old)
    assert all(not p.stat().st_mode & 0o022 for p in [path.parent, path, *path.rglob("*")])
    assert ck.resolve_resume(tmp_path / "root", "auto") == path
    (path / "s.pt").chmod(0o664)
    with pytest.raises(ck.CheckpointPermissionError, match=(
            rf"`{path / 's.pt'}` is writable by users other than its owner \(mode -rw-rw-r--\).*"
            rf"Fix: `chmod -R go-w {path}`")):
        ck.load_state(path, "s")
    (path / "s.pt").chmod(0o644)
    (tmp_path / "root").chmod(0o777)
    for call in (lambda: ck.resolve_resume(tmp_path / "root", "auto"),
                 lambda: ck.save_checkpoint(tmp_path / "root", 2, {"s": 2})):
        with pytest.raises(ck.CheckpointPermissionError, match=r"`chmod -R go-w .*root`"):
            call()


class Payload:
    def __reduce__(self):  # noqa: ANN204
        return (os.system, ("true",))


def test_states_load_weights_only(tmp_path: Path) -> None:
    """A pickle that runs code on load (what a writer of the checkpoint could plant) is refused."""
    path = ck.save_checkpoint(tmp_path, 1, {"evil": Payload(), "fine": {"w": torch.ones(1), "n": [1, 2.0, "x"]}})
    assert ck.load_state(path, "fine")["n"] == [1, 2.0, "x"]
    with pytest.raises(Exception, match="Weights only load failed"):
        ck.load_state(path, "evil")


CHILD = textwrap.dedent(
    """
    import sys, time, torch
    from trainer.checkpoint.full_state import save_checkpoint

    class Stall:
        # Pickling this object signals the parent, then blocks: the write is cut here.
        def __reduce__(self):
            open(sys.argv[2], "w").close()
            time.sleep(120)
            return (int, (0,))

    states = {"a_model": {"w": torch.ones(50_000)}, "b_blocked": [torch.ones(10), Stall()],
              "c_after": 1}
    save_checkpoint(sys.argv[1], 2, states)
    """
)


def test_writer_killed_mid_write_is_never_picked(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    first = ck.save_checkpoint(root, 1, {"a_model": {"w": torch.zeros(3)}})
    script, flag = tmp_path / "child.py", tmp_path / "writing"
    script.write_text(CHILD)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, str(script), str(root), str(flag)], env=env)
    try:
        deadline = time.monotonic() + 60
        while not flag.exists():
            assert proc.poll() is None, "the writer exited before reaching the blocking state"
            assert time.monotonic() < deadline, "the writer never started writing"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    partial = [p for p in root.iterdir() if re.match(r"\.tmp-[0-9a-f]{16}-global_step_2-", p.name)]
    assert len(partial) == 1 and (partial[0] / "a_model.pt").is_file()
    assert not (partial[0] / "manifest.json").exists()
    assert not (root / "global_step_2").exists()
    assert ck.find_latest_checkpoint(root) == first
    assert ck.read_latest_marker(root) == 1
    # The next save succeeds and clears the leftover of the killed writer.
    second = ck.save_checkpoint(root, 2, {"a_model": {"w": torch.ones(3)}})
    assert ck.find_latest_checkpoint(root) == second
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]


def test_hf_export_loads_with_from_pretrained(tmp_path: Path, tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer import models

    actor = models.load_actor(tiny_model_dir)
    tok = models.load_tokenizer(tiny_model_dir)
    with torch.no_grad():
        actor.model.embed_tokens.weight.add_(0.5)  # differs from the saved base model
    path = ck.save_checkpoint(
        tmp_path, 2, {"actor": actor.state_dict()}, hf_model=actor, hf_tokenizer=tok
    )
    assert ck.is_complete(path)
    assert "huggingface/config.json" in json.loads((path / "manifest.json").read_text())["files"]
    loaded = AutoModelForCausalLM.from_pretrained(path / ck.HF_DIR)
    torch.testing.assert_close(
        loaded.state_dict()["lm_head.weight"], actor.state_dict()["lm_head.weight"]
    )
    assert AutoTokenizer.from_pretrained(path / ck.HF_DIR).eos_token == tok.eos_token
    assert set(ck.load_checkpoint(path)) == {"actor"}


def test_rng_state_round_trip(tmp_path: Path) -> None:
    import numpy as np

    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    path = ck.save_checkpoint(tmp_path, 1, {"rng": ck.capture_rng_state()})
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    ck.restore_rng_state(ck.load_state(path, "rng"))
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]


def test_rng_state_of_a_process_without_cuda_never_starts_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    # the Ray driver on a GPU node: torch sees GPUs, but the process never started CUDA; reading
    # the CUDA generators (`get_rng_state_all`) would create a context on every GPU of the node
    started: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: started.append("get") or [])
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda _: started.append("set"))
    state = ck.capture_rng_state()
    ck.restore_rng_state({**state, "cuda": [torch.zeros(8, dtype=torch.uint8)]})
    assert "cuda" not in state and started == []
    # a worker that uses its GPU keeps its generator across a resume
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    state = ck.capture_rng_state()
    ck.restore_rng_state(state)
    assert "cuda" in state and started == ["get", "set"]


# --------------------------------------------------------------------------- sharded (DCP) states


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 8))


def _placed(fsdp: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The test network, sharded with FSDP2 over the process group when `fsdp`, and its AdamW."""
    model = _net()
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model[0])
        fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def _trained(world: int, rank: int, fsdp: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from trainer import parallel as P

    model, optim = _placed(fsdp)
    for step in range(2):
        x = torch.arange(128.0).reshape(2, 64) / 100 + step + rank
        model(x).pow(2).mean().backward()
        if not fsdp:
            P.all_reduce_gradients(model, world)
        optim.step()
        optim.zero_grad()
    return model, optim


def _full(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, object]:
    """The whole state gathered on rank 0 (the reference the sharded paths must reproduce)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from trainer import parallel as P

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {"model": P.full_model_state(model), "optim": get_optimizer_state_dict(model, optim, options=options)}


def _failing_writer(error: BaseException):  # noqa: ANN202
    """A DCP file-system writer whose data write raises `error` (the storage seam's stand-in)."""
    from torch.distributed.checkpoint import FileSystemWriter

    class Failing(FileSystemWriter):
        def write_data(self, plan, planner):  # noqa: ANN001, ANN202
            raise error

    return lambda path: Failing(path, sync_files=False)


def _rank_main(rank: int, world: int, port: int, mode: str, root: str) -> None:
    """One rank of a gloo group: `save` (FSDP2 shards of a trained net, plus the gathered
    reference on rank 0), `load` (into fresh FSDP2 shards, gathered on rank 0) or `fail` (rank 1's
    storage fails mid-save; every rank records what it raised)."""
    import torch.distributed as dist

    from trainer.checkpoint import sharded

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    out = Path(root)
    try:
        if mode == "save":
            model, optim = _trained(world, rank, fsdp=True)
            sharded.save_group_state(out / "ckpt" / "actor", model, optim)
            full = _full(model, optim)
            if rank == 0:
                torch.save(full, out / "reference.pt")
        elif mode == "load":
            model, optim = _placed(fsdp=True)
            sharded.load_group_state(out / "ckpt", "actor", model, optim)
            full = _full(model, optim)
            if rank == 0:
                torch.save(full, out / f"loaded_on_{world}.pt")
        else:
            model, optim = _trained(world, rank, fsdp=False)
            if rank == 1:
                sharded._storage_writer = _failing_writer(RuntimeError("rank 1 lost its storage"))
            try:
                sharded.save_group_state(out / "failed" / "actor", model, optim)
                (out / f"raised_{rank}").write_text("nothing")
            except BaseException as exc:  # noqa: BLE001 - recorded for the parent to check
                (out / f"raised_{rank}").write_text(f"{type(exc).__name__}: {exc}")
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_rank()


def _spawn(world: int, mode: str, root: Path) -> None:
    import torch.multiprocessing as mp

    from trainer import parallel as P

    mp.spawn(_rank_main, args=(world, P.free_port("127.0.0.1"), mode, str(root)), nprocs=world)


def _assert_same_state(got: dict, expected: dict) -> None:  # type: ignore[type-arg]
    assert got["model"].keys() == expected["model"].keys()
    for name, tensor in expected["model"].items():
        torch.testing.assert_close(got["model"][name], tensor, rtol=0, atol=0, msg=name)
    assert got["optim"]["state"].keys() == expected["optim"]["state"].keys()
    for name, moments in expected["optim"]["state"].items():
        for key, value in moments.items():
            torch.testing.assert_close(got["optim"]["state"][name][key], value, rtol=0, atol=0, msg=f"{name} {key}")


def test_sharded_state_written_on_two_ranks_loads_on_one_and_three(tmp_path: Path) -> None:
    """Two FSDP2 ranks over gloo each write only their own shards; the state loads bit for bit
    into one plain process and into three FSDP2 ranks (uneven shards), and reads offline."""
    from trainer.checkpoint import sharded

    _spawn(2, "save", tmp_path)
    reference = torch.load(tmp_path / "reference.pt", weights_only=False)
    shards = sorted((tmp_path / "ckpt" / "actor").glob("*.distcp"))
    assert len(shards) == 2 and (tmp_path / "ckpt" / "actor" / sharded.DCP_METADATA).is_file()
    total = sharded.state_bytes(reference)
    for shard in shards:  # each rank wrote about half of the state, not all of it
        assert shard.stat().st_size < 0.75 * total, (shard.name, shard.stat().st_size, total)
    _assert_same_state(sharded.read_group_state(tmp_path / "ckpt", "actor"), reference)
    model, optim = _placed(fsdp=False)  # one rank, no process group
    sharded.load_group_state(tmp_path / "ckpt", "actor", model, optim)
    _assert_same_state(_full(model, optim), reference)
    _spawn(3, "load", tmp_path)
    _assert_same_state(torch.load(tmp_path / "loaded_on_3.pt", weights_only=False), reference)


def test_a_rank_failing_mid_save_fails_the_save_on_every_rank(tmp_path: Path) -> None:
    """Rank 1's storage fails while rank 0 writes: both ranks raise (none hangs or returns), and
    DCP's `.metadata` is never written, so the directory can never pass for a saved state."""
    from trainer.checkpoint import sharded

    _spawn(2, "fail", tmp_path)
    for rank in (0, 1):
        raised = (tmp_path / f"raised_{rank}").read_text()
        assert raised.startswith("CheckpointException") and "rank 1 lost its storage" in raised, raised
    assert not sharded.has_group_state(tmp_path / "failed", "actor")


FSIZE_CHILD = textwrap.dedent(
    """
    import resource, signal, sys, torch
    from trainer.checkpoint import sharded

    model = torch.nn.Linear(200, 100)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 200)).sum().backward()
    optim.step()
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
    try:
        sharded.save_group_state(sys.argv[1], model, optim)
    except sharded.CheckpointWriteError as exc:
        print(exc)
        sys.exit(3)
    """
)


def test_a_file_size_limit_gives_a_clear_error_naming_directory_and_space(tmp_path: Path) -> None:
    """A real write failure (RLIMIT_FSIZE, as a quota would) becomes one clear error."""
    script = tmp_path / "child.py"
    script.write_text(FSIZE_CHILD)
    target = tmp_path / "ckpt" / "actor"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(script), str(target)], env=env, text=True,
                          capture_output=True, timeout=120)
    assert proc.returncode == 3, (proc.stdout, proc.stderr[-3000:])
    needed = (200 * 100 + 100) * 4 * 3 + 2 * 4  # weights, two Adam moments, two step counters
    assert f"writing the checkpoint to `{target}` failed: File too large (EFBIG)" in proc.stdout
    assert f"needs about 0.00 GiB ({needed} bytes); free space there now:" in proc.stdout, proc.stdout
    assert "trainer.default_local_dir" in proc.stdout


@pytest.fixture(scope="module")
def toy_digits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from trainer.rewards.toy import write_toy_digits

    out = tmp_path_factory.mktemp("toy")
    write_toy_digits(out, train_size=32, val_size=4, seed=0)
    return out


def test_driver_save_out_of_space_keeps_the_previous_checkpoint_and_refuses_old_ones(
        tmp_path: Path, tiny_model_dir: Path, toy_digits: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One rank in process: a full disk at the storage seam ends the save with an error naming
    the directory and the space needed, removes the temporary directory, and leaves the previous
    checkpoint the newest, which then loads; a gathered (`actor.pt`) checkpoint is refused."""
    import errno

    from trainer.checkpoint import sharded
    from trainer.config import load_config
    from trainer.driver import PPODriver

    run = tmp_path / "run"
    driver = PPODriver(load_config([
        f"data.train_files={toy_digits / 'train.parquet'}", f"data.val_files={toy_digits / 'test.parquet'}",
        "data.max_prompt_length=16", "data.max_response_length=8", "data.train_batch_size=4",
        f"actor_rollout_ref.model.path={tiny_model_dir}", "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "trainer.device=cpu", f"trainer.default_local_dir={run}", "trainer.logger=jsonl",
        "trainer.total_training_steps=3"]))
    state, stages = driver.state, driver.stages
    state.global_step = 1
    first = state.save(stages)
    assert sharded.has_group_state(first, "actor") and ck.is_complete(first)
    state.global_step = 2
    full = OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(sharded, "_storage_writer", _failing_writer(full))
    with pytest.raises(sharded.CheckpointWriteError, match=r"\.tmp-[0-9a-f]{16}-global_step_2-.*No space left on "
                       r"device \(ENOSPC\)\. The checkpoint needs about .* GiB \(\d+ bytes\)") as raised:
        state.save(stages)
    assert str(run) in str(raised.value)
    assert ck.find_latest_checkpoint(run) == first and ck.read_latest_marker(run) == 1
    assert not [p for p in run.iterdir() if p.name.startswith(".tmp-")]
    assert state.load(first, stages) == 1 and state.global_step == 1
    old = ck.save_checkpoint(run, 3, {"actor": {"w": torch.zeros(1)}, "trainer_state": {"global_step": 3}})
    with pytest.raises(sharded.CheckpointFormatError, match="gathered full state .*`actor.pt`.*"
                       "trainer.resume_mode=disable"):
        state.load(old, stages)
