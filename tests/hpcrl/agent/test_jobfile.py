from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpcrl.agent.jobfile import JobFileError, load_job, parse_job

DATA = Path(__file__).parents[2] / "data"


def load_job_text(text: str):
    return parse_job(json.loads(text))


JOB = {
    "version": 1,
    "site": "mi300-cluster",
    "nodes": 3,
    "max_requeues": 2,
    "payload": ["python3", "-m", "trainer.main_ppo", "trainer.nnodes=3"],
    "profile": {
        "slurm": {"partition": "gpu"},
        "network": {"interface": "ib0", "family": "ipv6"},
        "ray": {"dashboard": True, "dashboard_host": "0.0.0.0", "port_base": 30000},
        "container": {"runtime": "apptainer", "image": "/images/verl.sif"},
        "env": {"NCCL_IB_HCA": "mlx5", "HSA_FORCE_FINE_GRAIN_PCIE": 1},
    },
}


def test_parse_full_job(tmp_path: Path) -> None:
    (tmp_path / "job.json").write_text(json.dumps(JOB))
    job = load_job(tmp_path)
    assert job.payload[:3] == ("python3", "-m", "trainer.main_ppo") and job.nodes == 3
    assert job.network.interface == "ib0" and job.network.family == "ipv6"
    assert job.dashboard and job.dashboard_host == "0.0.0.0"
    assert job.ports.base == 30000 and job.runtime == "apptainer"
    assert job.env == {"NCCL_IB_HCA": "mlx5", "HSA_FORCE_FINE_GRAIN_PCIE": "1"}


def test_job_file_as_submission_writes_it() -> None:
    # the shape `hpcrl submit` writes: resolved profile as plain data, secrets by name only
    job = load_job_text((DATA / "job_mi300.json").read_text())
    assert job.runtime == "apptainer" and job.python is None and job.nodes == 3
    assert job.network.interface == "ib0" and job.network.family == "ipv6"
    assert job.ports.base == 20000  # port_base null: the default range
    assert job.secrets == ("WANDB_API_KEY",) and len(job.version_env) == 1
    assert job.profile["name"] == "mi300-cluster"
    assert not job.dashboard and job.dashboard_host == "127.0.0.1"


def test_defaults_are_safe() -> None:
    job = parse_job({"payload": ["true"]})
    assert not job.dashboard and job.dashboard_host == "127.0.0.1"
    assert job.runtime == "none" and job.network.family == "auto" and job.nodes == 1


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"payload": "python train.py"}, "non-empty list of strings"),
        ({"payload": []}, "non-empty list"),
        ({"payload": ["x"], "nodes": 0}, "at least 1"),
        ({"payload": ["x"], "profile": {"network": {"family": "v4"}}}, "auto, ipv4, ipv6"),
        ({"payload": ["x"], "profile": {"agent": {"grace": 1}}}, "valid keys: join_timeout_s"),
    ],
)
def test_bad_jobs(data: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        parse_job(data)


def test_missing_and_broken_file(tmp_path: Path) -> None:
    with pytest.raises(JobFileError, match="visible on every node"):
        load_job(tmp_path)
    (tmp_path / "job.json").write_text("{")
    with pytest.raises(JobFileError, match="not valid JSON"):
        load_job(tmp_path)
