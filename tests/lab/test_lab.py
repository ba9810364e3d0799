"""Acceptance tests of the Slurm test lab itself: real slurmctld/slurmd/munged in network
namespaces, real job steps, requeue and preemption, real Podman and Apptainer containers."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.lab import APPTAINER_BIN, IMAGE, SIF, parse_scontrol_record
from tests.lab.cluster import LAB_LABEL
from tests.lab.config import INSTANCE, NETNS_PREFIX, V4_NET, V6_NET, LabConfig

pytestmark = pytest.mark.lab
REPO = Path(__file__).resolve().parents[2]

REPORT_STEP = textwrap.dedent("""\
    #!/bin/bash
    #SBATCH --nodes={nodes}
    #SBATCH --output={out}/slurm-%j.out
    srun --ntasks-per-node=1 bash -c \
      'echo "STEP node=$(hostname) rank=$SLURM_NODEID ip=$(hostname --ip-address | tr " " ,) all=$(hostname -I | xargs | tr " " ,)"'
""")


def _steps(out: Path, job_id: int) -> dict[str, dict[str, str]]:
    text = (out / f"slurm-{job_id}.out").read_text()
    rows = [dict(kv.split("=", 1) for kv in line.split()[1:]) for line in text.splitlines() if line.startswith("STEP ")]
    return {row["node"]: row for row in rows}


# ------------------------------------------------------------------ pure parts


def test_parse_scontrol_record_keeps_values_with_spaces():
    text = (
        "JobId=7 JobName=wrap UserId=root(0) JobState=PENDING Reason=BeginTime Dependency=(null) "
        "Requeue=1 Restarts=1 BatchFlag=1 Command=/tmp/a b.sh WorkDir=/tmp NodeList=node[1-3]"
    )
    rec = parse_scontrol_record(text)
    assert rec["JobState"] == "PENDING"
    assert rec["Restarts"] == "1"
    assert rec["Command"] == "/tmp/a b.sh"
    assert rec["NodeList"] == "node[1-3]"
    assert rec["UserId"] == "root(0)"


def test_lab_config_addresses_and_validation():
    cfg = LabConfig(nodes=3)
    assert [h.name for h in cfg.compute] == ["node1", "node2", "node3"]
    assert [h.ipv6 for h in cfg.compute] == [f"{V6_NET}:11", f"{V6_NET}:12", f"{V6_NET}:13"]
    assert cfg.compute[0].slurm_addr == f"{V4_NET}.11"
    v6 = LabConfig(nodes=2, ipv6_only=True)
    assert [h.slurm_addr for h in v6.hosts] == [f"{V6_NET}:2", f"{V6_NET}:11", f"{V6_NET}:12"]
    if INSTANCE == 0:  # what the default lab's nodes print, as users' scripts see it
        assert (cfg.compute[0].ipv6, cfg.compute[0].ipv4) == ("fd77::11", "10.77.0.11")
    with pytest.raises(ValueError, match="`nodes`"):
        LabConfig(nodes=0)


# ------------------------------------------------------------------ cluster


@pytest.mark.parametrize("ipv6_only", [False, True], ids=["ipv4+ipv6", "ipv6-only"])
def test_three_node_job_runs_a_step_on_every_node(lab_manager, tmp_path, ipv6_only):
    lab = lab_manager.get(ipv6_only=ipv6_only)
    job = lab.sbatch(REPORT_STEP.format(nodes=3, out=tmp_path))
    rec = lab.wait_done(job, timeout=60)
    assert rec["JobState"] == "COMPLETED", rec
    steps = _steps(tmp_path, job)
    assert sorted(steps) == ["node1", "node2", "node3"]
    for host in lab.cfg.compute:
        row = steps[host.name]
        assert row["rank"] == str(int(host.name[4:]) - 1)
        ips = row["ip"].split(",")
        assert host.ipv6 in ips, row
        if ipv6_only:
            assert ips == [host.ipv6], f"an IPv6-only node must have no IPv4 address: {row}"
        else:
            assert host.ipv4 in ips and host.ipv4 in row["all"].split(","), row


def test_scontrol_requeue_reruns_with_restart_count(lab, tmp_path):
    marks = tmp_path / "runs"
    script = textwrap.dedent(f"""\
        #!/bin/bash
        #SBATCH --nodes=1
        #SBATCH --open-mode=append
        #SBATCH --output={tmp_path}/slurm-%j.out
        echo "run restart=${{SLURM_RESTART_COUNT:-unset}}" >> {marks}
        if [ -z "$SLURM_RESTART_COUNT" ]; then sleep 300; fi
    """)
    job = lab.sbatch(script)
    lab.wait_state(job, "RUNNING", timeout=30)
    _wait_for(lambda: marks.exists(), 15, "first run to start")
    t0 = time.monotonic()
    lab.run("scontrol", "requeue", str(job))
    rec = lab.wait_done(job, timeout=90)
    assert rec["JobState"] == "COMPLETED", rec
    assert rec["Restarts"] == "1", rec
    assert marks.read_text().splitlines() == ["run restart=unset", "run restart=1"]
    print(f"requeue to completed rerun: {time.monotonic() - t0:.1f} s")


def test_partition_preemption_requeues_low_priority_job(lab, tmp_path):
    marks = tmp_path / "runs"
    low = lab.sbatch(textwrap.dedent(f"""\
        #!/bin/bash
        #SBATCH --nodes=3
        #SBATCH --exclusive
        #SBATCH --partition=debug
        #SBATCH --output={tmp_path}/low-%j.out
        #SBATCH --open-mode=append
        echo "low restart=${{SLURM_RESTART_COUNT:-unset}}" >> {marks}
        if [ -z "$SLURM_RESTART_COUNT" ]; then sleep 300; fi
    """))
    lab.wait_state(low, "RUNNING", timeout=30)
    _wait_for(lambda: marks.exists(), 15, "the low-priority job to start")
    high = lab.sbatch(textwrap.dedent(f"""\
        #!/bin/bash
        #SBATCH --nodes=3
        #SBATCH --exclusive
        #SBATCH --partition=high
        #SBATCH --output={tmp_path}/high-%j.out
        echo "high ran" >> {marks}
    """))
    assert lab.wait_done(high, timeout=60)["JobState"] == "COMPLETED"
    rec = lab.wait_done(low, timeout=90)
    assert rec["JobState"] == "COMPLETED", rec
    assert int(rec["Restarts"]) >= 1, rec
    assert marks.read_text().splitlines() == ["low restart=unset", "high ran", "low restart=1"]


# ------------------------------------------------------------------ containers


def _python_binds() -> list[str]:
    return sorted({str(Path(sys.prefix).resolve()), str(Path(sys.base_prefix).resolve()), str(REPO)})


def _probe(runtime: str) -> str:
    return f'{sys.executable} -c "import ray, socket; print(\\"RAY {runtime}\\", ray.__version__, socket.gethostname())"'


@pytest.mark.containers
def test_containers_import_ray_inside_node_namespace(lab, lab_images, tmp_path):
    """`podman run` and `apptainer exec` of the lab image, inside a job step on node2 (its
    network, UTS and mount namespaces), import ray from the bind-mounted Python environment."""
    binds = _python_binds()
    podman = ["podman", "run", "--rm", "--network", "host"]
    for b in binds:
        podman += ["-v", f"{b}:{b}"]
    apptainer = [str(APPTAINER_BIN), "exec", "--cleanenv"]
    for b in binds:
        apptainer += ["--bind", b]
    script = textwrap.dedent(f"""\
        #!/bin/bash
        #SBATCH --nodes=1
        #SBATCH --nodelist=node2
        #SBATCH --output={tmp_path}/slurm-%j.out
        set -e
        {" ".join(podman)} {IMAGE} {_probe("podman")}
        {" ".join(apptainer)} {SIF} {_probe("apptainer")}
    """)
    job = lab.sbatch(script)
    rec = lab.wait_done(job, timeout=120)
    out = (tmp_path / f"slurm-{job}.out").read_text()
    assert rec["JobState"] == "COMPLETED", out
    import ray

    lines = [ln.split() for ln in out.splitlines() if ln.startswith("RAY ")]
    assert lines == [["RAY", "podman", ray.__version__, "node2"], ["RAY", "apptainer", ray.__version__, "node2"]], out


# ------------------------------------------------------------------ harness hygiene


@pytest.mark.containers
def test_down_after_crash_leaves_nothing_behind(lab_manager, lab_images, tmp_path):
    """A process that brings up the lab, starts a job and a container, then dies without
    tearing anything down; `python -m tests.lab down` must still leave nothing behind."""
    lab = lab_manager.get()
    job = lab.sbatch(f"#!/bin/bash\n#SBATCH --nodes=3\n#SBATCH --output={tmp_path}/s-%j.out\nsrun sleep 600\n")
    lab.wait_state(job, "RUNNING", timeout=30)
    crasher = subprocess.Popen(
        ["nsenter", f"--net=/run/netns/{NETNS_PREFIX}node1", "podman", "run", "--rm", "--label", LAB_LABEL,
         "--network", "host", IMAGE, "sleep", "600"]
    )
    _wait_for(_lab_container_exists, timeout=60, what="the crashing process's container")
    crasher.kill()  # the harness user crashed: nothing cleans up after it
    res = subprocess.run([sys.executable, "-m", "tests.lab", "down"], cwd=REPO, text=True, capture_output=True)
    from tests.lab.cluster import leftovers

    assert res.returncode == 0, res.stdout + res.stderr
    assert leftovers() == []
    lab_manager.current = None


def test_ci_true_turns_an_unstartable_lab_into_a_failure(tmp_path):
    """Under CI=true a lab test must not skip: point the lab at a directory that cannot be
    created and check the run fails (and skips without CI)."""
    test = tmp_path / "test_needs_lab.py"
    test.write_text("import pytest\npytestmark = pytest.mark.lab\ndef test_x(lab):\n    pass\n")
    (tmp_path / "conftest.py").write_text(f"import sys; sys.path.insert(0, {str(REPO)!r})\nfrom tests.conftest import *  # noqa\n")
    base = {k: v for k, v in os.environ.items() if k != "CI"}
    base["HPCRL_LAB_DIR"] = "/proc/hpcrl-lab-cannot-exist"
    for ci, expected, code in (("true", "1 error", 1), ("", "1 skipped", 0)):
        env = {**base, "CI": ci}
        res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test)],
                             cwd=tmp_path, env=env, text=True, capture_output=True, timeout=120)  # fmt: skip
        assert expected in res.stdout and res.returncode == code, res.stdout + res.stderr
        if ci:
            assert "required under CI=true" in res.stdout and "HPCRL_LAB_DIR" in res.stdout


def _lab_container_exists() -> bool:
    from tests.lab.cluster import lab_containers

    return bool(lab_containers())


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def test_sweep_leaves_the_next_test_a_clean_lab(lab, tmp_path):
    """What a test leaves (a job still running, a daemonized process in a node's namespace, as
    Ray's outlive a killed agent) is cancelled and killed by the sweep after each test, and named;
    the lab's own daemons stay up."""
    from tests.lab.cluster import strays

    job = lab.sbatch(f"#!/bin/bash\n#SBATCH --nodes=1\n#SBATCH --output={tmp_path}/s-%j.out\nsrun sleep 600\n")
    lab.wait_state(job, "RUNNING", timeout=30)
    daemon = subprocess.Popen(["nsenter", f"--net=/run/netns/{NETNS_PREFIX}node2", "setsid", "sleep", "611"],
                              start_new_session=True)  # fmt: skip
    daemon.wait()  # setsid forks when it leads a group: `sleep 611` runs on, parent gone
    _wait_for(lambda: any("sleep 611" in c for c in strays(lab.paths).values()), timeout=10,
              what="the stray process")
    cleaned = lab.sweep()
    assert f"job {job} " in "\n".join(cleaned), cleaned
    assert any("sleep 611" in c for c in cleaned), cleaned
    assert strays(lab.paths) == {}
    assert lab.run("squeue", "-h").stdout.strip() == ""
    assert lab.is_up()
    assert lab.sweep() == []  # a clean lab: nothing to do
