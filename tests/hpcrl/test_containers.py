"""Container command building for podman, docker, apptainer and none."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest

from hpcrl.containers import ContainerError, build_command, container_command, pull_command
from hpcrl.profile_load import load_profile
from hpcrl.profiles import ContainerConfig
from hpcrl.runtimes import get as get_runtime

SECRET = "s3cr3t-value-never-in-argv"


def profile(name: str, tmp_path: Path):  # type: ignore[no-untyped-def]
    env = {"HOME": str(tmp_path / "home"), "XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    return load_profile(name, env).profile


def test_podman_mi300_flags_and_env_names_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("hpcrl.runtimes.podman.rootless", lambda: False)
    p = profile("mi300-cluster", tmp_path)
    cmd = container_command(p.container, ["python3", "-m", "trainer", "a=1"], dict(p.env),
                            passthrough=["WANDB_API_KEY", "UNSET_SECRET"], binds=["/runs/r"],
                            workdir="/runs/r", name="hpcrl-1",
                            environ={"WANDB_API_KEY": SECRET})
    argv = list(cmd.argv)
    assert argv[:3] == ["podman", "run", "--rm"]
    for flag in ["--network=host", "--device=/dev/kfd", "--device=/dev/dri",
                 "--device=/dev/infiniband", "--group-add=video", "--cap-add=SYS_PTRACE",
                 "--security-opt=seccomp=unconfined", "--cap-add=IPC_LOCK", "--shm-size=128G"]:
        assert flag in argv, flag
    assert "--privileged" not in argv and argv[argv.index("--ulimit") + 1] == "memlock=-1:-1"
    assert argv[argv.index("--name") + 1] == "hpcrl-1"
    assert argv[argv.index("-w") + 1] == "/runs/r"
    assert f"{tmp_path}/home:{tmp_path}/home" in argv and "/runs/r:/runs/r" in argv
    assert argv[-5:] == ["localhost/hpcrl-rocm:latest", "python3", "-m", "trainer", "a=1"]
    e_names = [argv[i + 1] for i, a in enumerate(argv) if a == "-e"]
    assert set(e_names) == {*p.env, "WANDB_API_KEY"}  # the unset secret is not passed
    assert all("=" not in n for n in e_names)
    assert SECRET not in cmd.display() and "0,1,2,3,4,5,6,7" not in cmd.display()
    assert cmd.env["WANDB_API_KEY"] == SECRET and cmd.env["NCCL_PROTO"] == "Simple"


def test_rootless_podman_keeps_the_users_groups(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rootless, `--group-add video` would add the container's `video`, not the host's that owns
    /dev/kfd: podman's `keep-groups` (alone: it excludes other groups) keeps the user's own."""
    monkeypatch.setattr("hpcrl.runtimes.podman.rootless", lambda: True)
    p = profile("mi300-cluster", tmp_path)
    argv = list(container_command(p.container, ["true"], {}, environ={}).argv)
    assert [a for a in argv if a.startswith("--group-add")] == ["--group-add=keep-groups"]
    assert argv[:3] == ["podman", "run", "--rm"] and argv[-2:] == ["localhost/hpcrl-rocm:latest", "true"]
    for flag in ["--device=/dev/kfd", "--device=/dev/dri", "--device=/dev/infiniband"]:
        assert flag in argv, flag
    # docker (rootful daemon) and a profile asking for no group are left as they are
    docker = dataclasses.replace(p.container, runtime="docker")
    assert "--group-add=video" in container_command(docker, ["true"], {}, environ={}).argv
    lab = profile("slurmlab", tmp_path)
    assert not [a for a in container_command(lab.container, ["true"], {}, environ={}).argv
                if a.startswith("--group-add")]


def test_podman_rootless_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    from hpcrl.runtimes import podman

    monkeypatch.delenv("_CONTAINERS_USERNS_CONFIGURED", raising=False)
    monkeypatch.setattr(podman.os, "geteuid", lambda: 1000)
    assert podman.rootless()
    monkeypatch.setattr(podman.os, "geteuid", lambda: 0)
    assert not podman.rootless()
    monkeypatch.setenv("_CONTAINERS_USERNS_CONFIGURED", "1")  # root inside podman's user namespace
    assert podman.rootless()


def test_docker_uses_same_flags_with_its_binary(tmp_path: Path) -> None:
    p = profile("mi300-cluster", tmp_path)
    c = dataclasses.replace(p.container, runtime="docker", binary="/usr/bin/docker")
    argv = container_command(c, ["true"], {}, environ={}).argv
    assert argv[:3] == ("/usr/bin/docker", "run", "--rm") and "--device=/dev/kfd" in argv
    # rootful Docker would run the job as root: it runs as the job's user
    assert argv[3] == f"--user={os.getuid()}:{os.getgid()}"
    podman = container_command(p.container, ["true"], {}, environ={}).argv
    assert not [a for a in podman if a.startswith("--user")]  # rootless Podman is the user


def test_apptainer_rocm_through_spython_head(tmp_path: Path) -> None:
    p = profile("mi300-cluster-apptainer", tmp_path)
    cmd = container_command(p.container, ["python3", "-c", "pass"], {"A": "x y", "B": "$(no)"},
                            passthrough=["WANDB_API_KEY"], binds=["/runs/r"], workdir="/runs/r",
                            environ={"WANDB_API_KEY": SECRET})
    argv = list(cmd.argv)
    assert argv[:2] == ["apptainer", "exec"]
    # the image's own ROCm: the devices bound, not `--rocm` (the host's ROCm libraries first)
    assert "--rocm" not in argv and "--cleanenv" in argv and "--nv" not in argv
    assert argv[2:7] == ["--cleanenv", "--bind", "/dev/kfd", "--bind", "/dev/dri"]
    assert argv[argv.index("--pwd") + 1] == "/runs/r"
    binds = [argv[i + 1] for i, a in enumerate(argv) if a == "--bind"]
    assert binds == ["/dev/kfd", "/dev/dri", f"{tmp_path}/home", "/runs/r"]
    host = dataclasses.replace(p.container, gpu="rocm-host")
    host_argv = list(container_command(host, ["true"], {}, environ={}).argv)
    assert host_argv[:4] == ["apptainer", "exec", "--cleanenv", "--rocm"] and "/dev/kfd" not in host_argv
    assert argv[-4:] == [p.container.image, "python3", "-c", "pass"]
    assert "--device=/dev/kfd" not in argv and not any(a.startswith("--shm") for a in argv)
    assert cmd.env == {"APPTAINERENV_A": "x y", "APPTAINERENV_B": "\\$(no)",
                       "APPTAINERENV_WANDB_API_KEY": SECRET}
    assert SECRET not in cmd.display()


def test_apptainer_binary_from_profile_and_nv(tmp_path: Path) -> None:
    lab = profile("slurmlab-apptainer", tmp_path)
    argv = container_command(lab.container, ["env"], {}, environ={}).argv
    assert argv[0] == "/opt/hpcrl-lab/apptainer/bin/apptainer"
    assert argv[-2:] == ("/var/cache/hpcrl-lab/hpcrl-lab.sif", "env")
    h100 = profile("h100-cluster", tmp_path)
    assert "--nv" in container_command(h100.container, ["true"], {}, environ={}).argv


def test_none_runs_the_command_itself(tmp_path: Path) -> None:
    p = profile("local", tmp_path)
    cmd = container_command(p.container, ["python", "-V"], {"A": "1"}, passthrough=["S"],
                            environ={"S": SECRET})
    assert cmd.argv == ("python", "-V") and cmd.env == {"A": "1", "S": SECRET}


def test_binds_deduplicated_and_bad_input_refused() -> None:
    c = ContainerConfig(runtime="podman", image="img", binds=("/a", "/b:/c"))
    argv = container_command(c, ["x"], {}, binds=["/a", "/d"], environ={}).argv
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "-v"] == ["/a:/a", "/b:/c", "/d:/d"]
    with pytest.raises(ContainerError, match="not valid"):
        container_command(c, ["x"], {"BAD NAME": "1"}, environ={})
    with pytest.raises(ContainerError, match="empty command"):
        container_command(c, [], {}, environ={})
    with pytest.raises(ContainerError, match="SRC"):
        container_command(c, ["x"], {}, binds=[":/x"], environ={})
    with pytest.raises(ContainerError, match="needs `container.image`"):
        container_command(ContainerConfig(runtime="docker"), ["x"], {}, environ={})


def test_image_build_and_pull_commands(tmp_path: Path) -> None:
    apptainer = profile("h100-cluster", tmp_path).container
    build = build_command(apptainer, "/src/containers/hpcrl.def")
    assert build.argv == ("apptainer", "build", "--build-arg",
                          "BASE_IMAGE=docker.io/vllm/vllm-openai:v0.32.0",
                          f"{tmp_path}/home/images/hpcrl-cuda.sif", "/src/containers/hpcrl.def")
    pull = pull_command(apptainer, "docker-archive:///tmp/img.tar")
    assert pull.argv == ("apptainer", "pull", f"{tmp_path}/home/images/hpcrl-cuda.sif",
                         "docker-archive:///tmp/img.tar")
    with pytest.raises(ContainerError, match="needs a source"):
        pull_command(apptainer)
    podman = profile("mi300-cluster", tmp_path).container
    assert build_command(podman, "D", "/ctx").argv == (
        "podman", "build", "-f", "D", "-t", "localhost/hpcrl-rocm:latest", "/ctx")
    assert pull_command(podman).argv == ("podman", "pull", "localhost/hpcrl-rocm:latest")


PRINT_ENV = ["-c", "import json, os; print(json.dumps(dict(os.environ)))"]
def test_apptainer_home_travels_as_home_flag(tmp_path: Path) -> None:
    """Apptainer ignores `APPTAINERENV_HOME`: a profile's HOME becomes `--home`, never a no-op."""
    p = profile("mi300-cluster-apptainer", tmp_path)
    cmd = container_command(p.container, ["true"], {"HOME": "/scratch/u", "A": "1"}, environ={})
    argv = list(cmd.argv)
    assert argv[argv.index("--home") + 1] == "/scratch/u"
    assert "APPTAINERENV_HOME" not in cmd.env and cmd.env["APPTAINERENV_A"] == "1"


HOSTILE = ["$(echo subst)", "`echo tick`", "${HOME} $HOME", "it's", 'q"q', "back\\slash",
           "trail\\", '\\"', "new\nline", "tab\there", "semi;colon|&", "\\$", "!x *"]


@pytest.mark.containers
@pytest.mark.parametrize("site", ["slurmlab", "slurmlab-apptainer"])
def test_real_runtime_delivers_every_value(site: str, tmp_path: Path, lab_images: None) -> None:
    """With the lab's images (built by the fixture if missing): every profile variable and the
    secret arrive intact."""
    p = load_profile(site, {**os.environ, "HOME": str(tmp_path / "home")}).profile
    c = p.container
    env = {**p.env, **{f"HOSTILE_{i}": v for i, v in enumerate(HOSTILE)}}
    cmd = container_command(c, [os.path.realpath("/usr/bin/python3"), *PRINT_ENV],
                            env, passthrough=["WANDB_API_KEY"],
                            environ={"WANDB_API_KEY": SECRET + "$(x)"})
    out = subprocess.run(list(cmd.argv), env={**os.environ, **cmd.env}, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    for k, v in env.items():
        assert seen.get(k) == v, k
    assert seen["WANDB_API_KEY"] == SECRET + "$(x)"


RECORD_ARGV = """#!{python}
import json, os, sys
with open(os.environ["RUNTIME_LOG"], "a") as fh:
    fh.write(json.dumps({{"argv": sys.argv[1:], "cwd": os.getcwd()}}) + "\\n")
"""


def test_image_cli_runs_the_runtime(tmp_path: Path) -> None:
    """`hpcrl image build|pull` run the profile's runtime executable (here a recorder)."""
    import sys

    from tests.conftest import REPO, run_hpcrl, write_exe

    runtime = write_exe(tmp_path / "bin" / "apptainer", RECORD_ARGV.format(python=sys.executable))
    sites = tmp_path / "sites"
    sites.mkdir()
    (sites / "img.yaml").write_text(
        f"extends: mi300-cluster-apptainer\ncontainer: {{binary: {runtime}, "
        f"image: {tmp_path}/out.sif}}\n")
    env = {"HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "HPCRL_SITE_PATH": str(sites),
           "RUNTIME_LOG": str(tmp_path / "runtime.jsonl")}
    build = run_hpcrl(["image", "build", "--site", "img"], env)
    assert build.returncode == 0, build.stderr
    pull = run_hpcrl(["image", "pull", "--site", "img", "--from", "docker-archive://x.tar"], env)
    assert pull.returncode == 0, pull.stderr
    dry = run_hpcrl(["image", "pull", "--site", "img", "--from", "docker://a/b", "--dry-run"],
                    env)
    assert dry.returncode == 0 and "pull" in dry.stderr and "docker://a/b" in dry.stderr
    rows = [json.loads(ln) for ln in (tmp_path / "runtime.jsonl").read_text().splitlines()]
    assert rows[0]["argv"] == ["build", f"{tmp_path}/out.sif", str(REPO / "containers/hpcrl.def")]
    assert rows[0]["cwd"] == str(REPO)  # the .def's %files are relative to the source tree
    assert rows[1]["argv"] == ["pull", f"{tmp_path}/out.sif", "docker-archive://x.tar"]
    assert len(rows) == 2  # the dry run ran nothing
    missing = run_hpcrl(["image", "build", "--site", "slurmlab"], env)
    assert missing.returncode == 2 and "no `container.recipe`" in missing.stderr


def test_enroot_commands_follow_its_cli() -> None:
    """`enroot start --rw --env NAME --mount SRC:DST IMAGE CMD`, `enroot import --output`,
    `enroot create --name` (enroot's doc/cmd/*.md); values only in the client's environment."""
    c = ContainerConfig(runtime="enroot", image="/img/hpcrl.sqsh", binds=("/data:/d:ro",))
    cmd = container_command(c, ["python3", "x.py"], {"A": "1"}, passthrough=["S"],
                            binds=["/runs/r"], workdir="/runs/r", environ={"S": SECRET})
    assert cmd.argv == (
        "enroot", "start", "--rw", "--env", "A", "--env", "S",
        "--mount", "/data:/d:none:x-create=dir,bind,ro", "--mount", "/runs/r:/runs/r",
        "/img/hpcrl.sqsh", "sh", "-c", 'cd "$1" && shift && exec "$@"', "sh", "/runs/r",
        "python3", "x.py")
    assert cmd.env == {"A": "1", "S": SECRET} and SECRET not in cmd.display()
    out = subprocess.run(["sh", "-c", cmd.argv[14], cmd.argv[15], "/", "pwd"],
                         capture_output=True, text=True)
    assert out.stdout == "/\n"  # the working-directory wrapper really changes directory
    assert pull_command(c, "docker://nvcr.io#nvidia/pytorch:24.01-py3").argv == (
        "enroot", "import", "--output", "/img/hpcrl.sqsh",
        "docker://nvcr.io#nvidia/pytorch:24.01-py3")
    with pytest.raises(ContainerError, match="ending in `.sqsh`"):
        pull_command(dataclasses.replace(c, image="hpcrl"), "docker://x")
    named = dataclasses.replace(c, image="hpcrl", binary="/opt/enroot/bin/enroot")
    assert build_command(named, "/img/hpcrl.sqsh").argv == (
        "/opt/enroot/bin/enroot", "create", "--name", "hpcrl", "/img/hpcrl.sqsh")
    with pytest.raises(ContainerError, match="FILE.sqsh"):
        build_command(named, "containers/Dockerfile.cuda")


def test_runtime_table_is_the_one_list() -> None:
    """The profile's choices are the table's names; each runtime names its own module's entry
    and says how it recognises its containers."""
    from hpcrl import runtimes

    assert runtimes.NAMES == ("none", "podman", "docker", "apptainer", "enroot")
    field = {f.name: f for f in dataclasses.fields(ContainerConfig)}["runtime"]
    assert tuple(field.metadata["choices"]) == runtimes.NAMES
    assert all(r.name == n for n, r in runtimes.TABLE.items())
    with pytest.raises(ContainerError, match="`lxc` is unknown; valid: none, podman"):
        runtimes.get("lxc")
    on_host = runtimes.running_in({}, lambda p: False)
    in_podman = runtimes.running_in({}, lambda p: p == "/run/.containerenv")
    # a host that is itself a Docker container has `/.dockerenv`: no job container is claimed
    on_docker_host = runtimes.running_in({}, lambda p: p == "/.dockerenv")
    in_apptainer = runtimes.running_in({"APPTAINER_CONTAINER": "/x.sif"}, lambda p: False)
    assert (on_host, in_podman, on_docker_host, in_apptainer) == ("none", "podman", "none",
                                                                   "apptainer")


def test_each_runtime_says_when_a_node_cannot_open_its_image(tmp_path: Path) -> None:
    """The agent's check before Ray starts: file images must be there and readable; a
    `localhost/` OCI tag must be in the node's store; references a runtime pulls are left to it."""
    ran: list[list[str]] = []

    def run(argv):  # the one side effect: `podman image inspect` answering "not found"
        ran.append(list(argv))
        return 125

    app = profile("mi300-cluster-apptainer", tmp_path).container
    sif = tmp_path / "img.sif"
    assert "does not exist on this node" in get_runtime("apptainer").image_problem(
        dataclasses.replace(app, image=str(sif)), run)
    sif.write_bytes(b"SIF")
    assert get_runtime("apptainer").image_problem(dataclasses.replace(app, image=str(sif)), run) is None
    sif.chmod(0)
    if os.geteuid() != 0:  # root reads any file
        assert "is not readable" in get_runtime("apptainer").image_problem(
            dataclasses.replace(app, image=str(sif)), run)
    assert get_runtime("apptainer").image_problem(dataclasses.replace(app, image="docker://x/y"), run) is None
    pod = profile("mi300-cluster", tmp_path).container
    problem = get_runtime("podman").image_problem(pod, run)
    assert pod.image.startswith("localhost/") and "is not in podman's image store" in problem
    assert ran == [["podman", "image", "inspect", "--format", "{{.Id}}", pod.image]]
    assert get_runtime("podman").image_problem(dataclasses.replace(pod, image="docker.io/x/y:1"), run) is None
    assert len(ran) == 1  # a pullable reference is not looked up
    assert get_runtime("none").image_problem(pod, run) is None
