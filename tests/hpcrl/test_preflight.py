"""The mistakes a newcomer makes first each get one message with the fix, before anything is
created: no Slurm for a Slurm site, unknown site, missing model, dataset without verl's
columns, no space for a checkpoint."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hpcrl import preflight as pf
from tests.conftest import run_hpcrl


@pytest.fixture
def model(tmp_path: Path) -> Path:
    """A model directory as `save_pretrained` leaves it (weights of 1 MB, fp32)."""
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text('{"torch_dtype": "float32"}')
    (d / "model.safetensors").write_bytes(b"\0" * 1_000_000)
    return d


@pytest.fixture
def data(tmp_path: Path) -> Path:
    d = tmp_path / "data"
    d.mkdir()
    rows = {"data_source": ["toy"], "prompt": [[{"role": "user", "content": "hi"}]],
            "reward_model": [{"style": "rule", "ground_truth": "7"}]}
    pq.write_table(pa.table(rows), d / "train.parquet")
    pq.write_table(pa.table({"question": ["q"], "answer": ["a"]}), d / "raw.parquet")
    return d


#: The critic's micro-batch, which the trainer (as verl) requires of its default estimator, gae.
CRITIC = "critic.ppo_micro_batch_size_per_gpu=4"


def args(model: Path, train: Path, *extra: str) -> list[str]:
    return [f"actor_rollout_ref.model.path={model}", f"data.train_files={train}",
            "trainer.val_before_train=false", CRITIC, *extra]


def test_a_good_job_passes(model: Path, data: Path, tmp_path: Path) -> None:
    assert pf.check_trainer_job(args(model, data / "train.parquet"), tmp_path / "run") == []


def test_no_sbatch_for_a_slurm_site() -> None:
    assert pf.check_scheduler("local", "local", which=lambda _: None) == []
    assert pf.check_scheduler("h100", "slurm", which=lambda _: "/usr/bin/sbatch") == []
    [msg] = pf.check_scheduler("h100", "slurm", which=lambda _: None)
    assert "`sbatch` is not on PATH" in msg and "--site local" in msg and "module load" in msg


def test_local_site_is_one_node() -> None:
    assert pf.check_local_nodes("local", "local", 1) == []
    assert pf.check_local_nodes("h100", "slurm", 4) == []
    [msg] = pf.check_local_nodes("local", "local", 2)
    assert "`--nodes 2` on site `local`" in msg and "drop `--nodes`" in msg


def test_missing_model_and_default_paths(data: Path, tmp_path: Path) -> None:
    [msg] = pf.check_trainer_job(args(tmp_path / "nope", data / "train.parquet"), tmp_path)
    assert f"`actor_rollout_ref.model.path` is `{tmp_path / 'nope'}`, which does not exist" in msg
    not_a_model = tmp_path / "empty"
    not_a_model.mkdir()
    [msg] = pf.check_trainer_job(args(not_a_model, data / "train.parquet"), tmp_path)
    assert "has no `config.json`" in msg
    problems = pf.check_trainer_job([CRITIC], tmp_path)  # nothing else given: the trainer's defaults
    assert len(problems) == 3 and all("its default; you did not set it" in p for p in problems)
    [problem] = pf.check_trainer_job([], tmp_path)  # verl's defaults: gae, and no critic micro-batch
    assert "`critic.ppo_micro_batch_size_per_gpu`" in problem and "verl's CriticConfig refuses this" in problem


def test_relative_paths_are_refused_with_the_absolute_form(model: Path, tmp_path: Path) -> None:
    [msg] = pf.check_trainer_job(args(model, Path("data/train.parquet")), tmp_path / "run")
    assert "relative path `data/train.parquet`" in msg
    assert "`data.train_files=$PWD/data/train.parquet`" in msg


def test_dataset_columns(model: Path, data: Path, tmp_path: Path) -> None:
    [msg] = pf.check_trainer_job(args(model, data / "raw.parquet"), tmp_path)
    assert "lacks column(s) `prompt`, `data_source`, `reward_model`" in msg
    assert "(it has question, answer)" in msg and "python -m trainer.preprocess gsm8k" in msg
    renamed = args(model, data / "raw.parquet", "data.prompt_key=question")
    [msg] = pf.check_trainer_job(renamed, tmp_path)
    assert "lacks column(s) `data_source`, `reward_model`" in msg
    listed = pf.check_trainer_job(
        args(model, f"[{data / 'train.parquet'}, {data / 'raw.parquet'}]"), tmp_path)
    assert len(listed) == 1 and "raw.parquet" in listed[0]
    val = [f"actor_rollout_ref.model.path={model}", f"data.train_files={data / 'train.parquet'}",
           f"data.val_files={data / 'raw.parquet'}", CRITIC]  # validation runs by default
    [msg] = pf.check_trainer_job(val, tmp_path)
    assert msg.startswith("`data.val_files`")
    (data / "junk.parquet").write_text("not parquet")
    [msg] = pf.check_trainer_job(args(model, data / "junk.parquet"), tmp_path)
    assert "cannot be read as parquet" in msg


def test_a_dataset_class_reads_its_own_files_and_class_files_must_exist(model: Path, data: Path,
                                                                        tmp_path: Path) -> None:
    """With `data.custom_cls` the data files are the class's to read (their columns are not
    checked); the class files must exist, as absolute paths (the trainer runs in the run directory)."""
    (data / "cls.py").write_text("class D: pass\n")
    custom = [f"data.custom_cls.path={data / 'cls.py'}", "data.custom_cls.name=D"]
    assert pf.check_trainer_job(args(model, data / "raw.parquet", *custom), tmp_path) == []
    sampler = ["data.sampler.class_name=S", "data.dataloader_num_workers=0"]
    [msg] = pf.check_trainer_job(args(model, data / "train.parquet", f"data.sampler.class_path={data / 'gone.py'}",
                                      *sampler), tmp_path)
    assert msg.startswith("`data.sampler.class_path`") and "does not exist" in msg
    [msg] = pf.check_trainer_job(args(model, data / "train.parquet", "data.sampler.class_path=s.py", *sampler),
                                 tmp_path)
    assert "relative path `s.py`" in msg and "Fix: give an absolute path" in msg
    assert pf.check_trainer_job(args(model, data / "train.parquet", "data.sampler.class_path=pkg://mine.s",
                                     *sampler), tmp_path) == []


def test_no_space_for_a_checkpoint(model: Path, data: Path, tmp_path: Path) -> None:
    need = pf.checkpoint_bytes(model, with_critic=False)
    assert need == int(1_000_000 * 4 * 1.1)
    assert pf.checkpoint_bytes(model, with_critic=True) == int(1_000_000 * 7 * 1.1)
    seen: list[Path] = []

    def free(path: Path) -> int:
        seen.append(path)
        return need - 1

    [msg] = pf.check_trainer_job(args(model, data / "train.parquet",
                                      "trainer.default_local_dir=/big/ckpt",
                                      "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2"), tmp_path, free=free)
    assert seen == [Path("/big/ckpt")]
    assert "checkpoints go to `/big/ckpt`, whose filesystem has 4.4 MB free" in msg
    assert "needs about 4.4 MB" in msg and pf.format_bytes(3 * pf.GIB) == "3.00 GiB"
    assert "set `trainer.default_local_dir=`" in msg
    assert pf.check_trainer_job(args(model, data / "train.parquet", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2"),
                                tmp_path, free=lambda _: need) == []


def test_submit_local_stops_before_creating_anything(tmp_path: Path, data: Path) -> None:
    run = tmp_path / "run"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = run_hpcrl(["submit", "--site", "local", "--run-dir", str(run), "--",
                      f"actor_rollout_ref.model.path={tmp_path / 'nope'}",
                      f"data.train_files={data / 'raw.parquet'}", "trainer.val_before_train=false", CRITIC],
                     env)
    assert proc.returncode == 2
    assert proc.stderr.startswith("hpcrl: error: 2 problems:")
    assert "does not exist" in proc.stderr and "lacks column(s)" in proc.stderr
    assert not run.exists()


def test_unknown_site_lists_the_known_ones(tmp_path: Path) -> None:
    proc = run_hpcrl(["submit", "--site", "nosuch", "--", "a=1"],
                     {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert proc.returncode == 2
    assert "no site profile `nosuch`" in proc.stderr and "local" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_slurm_site_without_sbatch(tmp_path: Path) -> None:
    proc = run_hpcrl(["submit", "--site", "h100-cluster", "--run-dir", str(tmp_path / "r"), "--",
                      "a=1"], {"PATH": str(tmp_path), "HOME": str(tmp_path)})
    assert proc.returncode == 2 and "`sbatch` is not on PATH" in proc.stderr
    assert not (tmp_path / "r").exists()


def test_overrides_the_trainer_refuses_stop_the_submission(tmp_path: Path, model: Path, data: Path) -> None:
    """Read by the trainer's own rules (verl's grammar, interpolations): a refused override is
    fatal at submit, and the values the checks see are the resolved ones."""
    problems = pf.check_trainer_job(args(model, data / "train.parquet", "data.max_prompt_length=${nope}"),
                                    tmp_path / "run")
    assert len(problems) == 1 and "the trainer overrides are refused" in problems[0]
    assert "the interpolation cannot be resolved" in problems[0]
    resolved = [f"actor_rollout_ref.model.path={model}", "trainer.experiment_name=" + str(data),
                "data.train_files=${trainer.experiment_name}/raw.parquet", "trainer.val_before_train=false", CRITIC]
    assert any("lacks column(s)" in p for p in pf.check_trainer_job(resolved, tmp_path / "run"))
    run = tmp_path / "run"
    proc = run_hpcrl(["submit", "--site", "local", "--run-dir", str(run), "--",
                      *args(model, data / "train.parquet", "data.train_files=a.parquet,b.parquet")],
                     {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert proc.returncode == 2 and "is a sweep in Hydra's grammar" in proc.stderr, proc.stderr
    assert not run.exists()


def test_settings_the_trainer_refuses_at_its_start_are_refused_before_submission() -> None:
    """Not only the grammar: the trainer's whole check runs at submit time (a refusal after the
    queue wait would cost the user hours), with the nodes the job asks for."""
    tp = ["actor_rollout_ref.rollout.tensor_model_parallel_size=2", "trainer.nnodes=${oc.env:HPCRL_NUM_NODES}",
          "data.train_batch_size=6", "actor_rollout_ref.actor.ppo_mini_batch_size=6", CRITIC]
    assert pf.parse_overrides(tp, {"HPCRL_NUM_NODES": "2"})[1] == []
    _, [problem] = pf.parse_overrides(tp, {"HPCRL_NUM_NODES": "3"})
    assert "must divide the 3 ranks" in problem


def test_the_trainers_gpus_per_node_follow_the_sites_gpus(tmp_path: Path) -> None:
    """verl's ROCm GRPO line sets no `trainer.n_gpus_per_node` (verl: 8): on a site that asks
    Slurm for 8 GPUs per node it is checked with 8 ranks a node (a rollout engine of 2 fits), on
    a CPU site with one, and refused there."""
    from hpcrl.runreport import reading_env

    assert reading_env(2, tmp_path, {"slurm": {"gpus_per_node": 8}})["HPCRL_GPUS_PER_NODE"] == "8"
    assert reading_env(2, tmp_path)["HPCRL_GPUS_PER_NODE"] == "0"
    grpo = ["algorithm.adv_estimator=grpo", "data.train_batch_size=1024",
            "actor_rollout_ref.actor.ppo_mini_batch_size=256", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
            "actor_rollout_ref.rollout.n=5", "actor_rollout_ref.ref.fsdp_config.param_offload=True"]
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    ok = run_hpcrl(["submit", "--dry-run", "--via", "sbatch", "--site", "h100-cluster", "--", *grpo], env)
    assert ok.returncode == 0, ok.stderr
    cpu = run_hpcrl(["submit", "--dry-run", "--via", "sbatch", "--site", "slurmlab", "--", *grpo], env)
    assert cpu.returncode == 2 and "must divide the 1 ranks" in cpu.stderr, cpu.stderr


def test_a_rollout_pool_is_submitted_with_its_loop_and_sized_with_the_trainers_nodes(tmp_path: Path) -> None:
    """verl's one-step-off line: the synchronous trainer refuses it naming `--loop one-step-off`;
    with that loop the job runs `python -m trainer.one_step_off`, and its nodes must hold both
    pools (`trainer.nnodes` + `rollout.nnodes`), refused before the queue otherwise."""
    pool = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.hybrid_engine=false", "rollout.nnodes=1",
            "rollout.n_gpus_per_node=8", "trainer.nnodes=1", "data.train_batch_size=64",
            "actor_rollout_ref.actor.ppo_mini_batch_size=16", "actor_rollout_ref.rollout.n=4"]
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    sync = run_hpcrl(["submit", "--dry-run", "--via", "sbatch", "--site", "h100-cluster", "--nodes", "2",
                      "--", *pool], env)
    assert sync.returncode == 2 and "`hpcrl submit --loop one-step-off`" in sync.stderr, sync.stderr
    ok = run_hpcrl(["submit", "--dry-run", "--via", "sbatch", "--site", "h100-cluster", "--nodes", "2",
                    "--loop", "one-step-off", "--", *pool], env)
    assert ok.returncode == 0, ok.stderr
    assert "-m trainer.one_step_off" in ok.stdout, ok.stdout
    short = run_hpcrl(["submit", "--dry-run", "--via", "sbatch", "--site", "h100-cluster", "--nodes", "1",
                       "--loop", "one-step-off", "--", *pool], env)
    assert short.returncode == 2 and "`trainer.nnodes=1` + `rollout.nnodes=1` = 2 nodes" in short.stderr, short.stderr
    # the fully-async loop: its module, and verl's rollouter assertions checked before the queue
    streamed = [*pool, "data.train_batch_size=0", "data.gen_batch_size=1", "async_training.partial_rollout=false"]
    fully = run_hpcrl(["submit", "--dry-run", "--via", "sbatch", "--site", "h100-cluster", "--nodes", "2",
                       "--loop", "fully-async", "--", *streamed], env)
    assert fully.returncode == 0, fully.stderr
    assert "-m trainer.fully_async" in fully.stdout, fully.stdout
    batch = run_hpcrl(["submit", "--dry-run", "--via", "sbatch", "--site", "h100-cluster", "--nodes", "2",
                       "--loop", "fully-async", "--", *pool], env)
    assert batch.returncode == 2 and "train_batch_size must be zero" in batch.stderr, batch.stderr


def test_a_path_outside_the_containers_binds_is_named_with_the_bind_to_add(model: Path, data: Path,
                                                                            tmp_path: Path) -> None:
    """Podman and Docker show a container the run directory and `container.binds` alone: a model
    or dataset elsewhere would be missing at the trainer's start, on the compute nodes; named at
    submission with the bind to add. Apptainer binds more by its own configuration: not judged."""
    overrides = {"actor_rollout_ref.model.path": str(model), "data.train_files": f"[{data / 'train.parquet'}]",
                 "trainer.val_before_train": "false",
                 "custom_reward_function.path": str(tmp_path / "run" / "reward.py")}  # inside the run directory
    found = pf.check_binds(overrides, tmp_path / "run", "podman", ["/usr", f"/elsewhere:{data}:ro"])
    assert len(found) == 1 and f"`actor_rollout_ref.model.path` is `{model}`, which the job's container will not see: " \
        "podman shows it only the run directory and `container.binds` (/usr, " in found[0], found
    assert f"Fix: add `{model.parent}` (or a folder above it) to the site profile's `container.binds`" in found[0]
    assert pf.check_binds(overrides, tmp_path / "run", "podman", [str(tmp_path)]) == []
    assert pf.check_binds(overrides, tmp_path / "run", "apptainer", []) == []
    assert pf.bind_target("/a:/b:ro") == "/b" and pf.bind_target("/a") == "/a"
    proc = run_hpcrl(["render", "--site", "slurmlab", "--no-prepare", "--run-dir", str(tmp_path / "r"), "--",
                      *args(model, data / "train.parquet")], {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr  # a warning: the image may hold the path
    assert f"hpcrl: warning: `actor_rollout_ref.model.path` is `{model}`, which the job's container will not " \
           "see: podman shows it only" in proc.stderr, proc.stderr
