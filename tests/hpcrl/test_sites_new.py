"""`hpcrl sites new`: the parsers on real and Slurm-format outputs, the plan from them, the
written profile (it loads; every value has its source; NIC settings only proposed), and the
command without a terminal. The lab run (real Slurm, then `hpcrl submit` with the profile) is
`tests/lab/test_agent.py::test_sites_new_profile_runs_a_job_unchanged`."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest
import yaml

from hpcrl import sitenew
from hpcrl.profile_load import load_profile
from hpcrl.sitedetect import (
    Gres,
    Probe,
    hca_ports,
    net_interfaces,
    parse_gres,
    parse_nodes,
    parse_partitions,
    roce_v2_gid_index,
)
from tests.conftest import DATA, PYTHON, REPO, write_exe

SLURM = DATA / "slurm"


# The `*_lab.txt` outputs are the lab's own (Slurm 22.05); the `*_gpu.txt` ones are composed in
# the same `--oneliner` format for a cluster with a CPU and an MI300X partition, and the sysfs
# trees below follow the kernel's /sys/class/infiniband and /sys/class/net layout.


def test_parse_gres() -> None:
    assert parse_gres("gpu:mi300x:8(S:0-1)") == Gres(8, "mi300x")
    assert parse_gres("gpu:4") == Gres(4, None)
    assert parse_gres("gpu:h100:4(S:0),gpu:h100:4(S:1),shard:8") == Gres(8, "h100")
    assert parse_gres("(null)") is None and parse_gres("") is None
    assert Gres(8, "mi300x").vendor == "amd" and Gres(8, "mi300x").memory_gib == 192
    assert Gres(4, "h100").vendor == "nvidia" and Gres(4, None).vendor is None


def test_parse_lab_scontrol_output() -> None:
    """Real `scontrol show partition|node --oneliner` of the lab (Slurm 22.05)."""
    parts = parse_partitions((SLURM / "scontrol_show_partition_lab.txt").read_text())
    assert [(p.name, p.default, p.max_time, p.total_nodes) for p in parts] == [
        ("debug", True, None, 3), ("high", False, None, 3)]
    nodes = parse_nodes((SLURM / "scontrol_show_node_lab.txt").read_text())
    assert [(n.name, n.partitions, n.cpus, n.memory_mb, n.gres) for n in nodes] == [
        (f"node{i}", ("debug", "high"), 2, 4000, None) for i in (1, 2, 3)]


def test_roce_v2_gid_index() -> None:
    gids = [(0, "fe80:0000:0000:0000:0e42:a1ff:fe5c:10a0", "IB/RoCE v1"),
            (1, "fe80:0000:0000:0000:0e42:a1ff:fe5c:10a0", "RoCE v2"),
            (2, "0000:0000:0000:0000:0000:ffff:0a01:0203", "IB/RoCE v1"),
            (3, "0000:0000:0000:0000:0000:ffff:0a01:0203", "RoCE v2\n")]
    assert roce_v2_gid_index(gids) == 3
    assert roce_v2_gid_index(gids[:3]) is None


def write_sys(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def gpu_sysfs(root: Path) -> Path:
    """Two HCAs (InfiniBand, active), one RoCE port, one down; ib0 (IPoIB) and eth0."""
    ib = "class/infiniband"
    files = {f"{ib}/mlx5_0/ports/1/state": "4: ACTIVE\n", f"{ib}/mlx5_0/ports/1/link_layer": "InfiniBand\n",
             f"{ib}/mlx5_0/ports/1/rate": "400 Gb/sec (4X NDR)\n",
             f"{ib}/mlx5_1/ports/1/state": "4: ACTIVE\n", f"{ib}/mlx5_1/ports/1/link_layer": "InfiniBand\n",
             f"{ib}/mlx5_1/ports/1/rate": "400 Gb/sec (4X NDR)\n",
             f"{ib}/mlx5_2/ports/1/state": "1: DOWN\n", f"{ib}/mlx5_2/ports/1/link_layer": "InfiniBand\n",
             f"{ib}/mlx5_3/ports/1/state": "4: ACTIVE\n", f"{ib}/mlx5_3/ports/1/link_layer": "Ethernet\n",
             f"{ib}/mlx5_3/ports/1/gid_attrs/types/3": "RoCE v2\n",
             f"{ib}/mlx5_3/ports/1/gids/3": "0000:0000:0000:0000:0000:ffff:0a01:0203\n",
             "class/net/ib0/type": "32\n", "class/net/ib0/operstate": "up\n",
             "class/net/eth0/type": "1\n", "class/net/eth0/operstate": "up\n",
             "class/net/lo/type": "772\n", "class/net/lo/operstate": "unknown\n"}
    return write_sys(root, files)


IP_JSON = ('[{"ifname": "eth0", "flags": ["UP"], "addr_info": [{"family": "inet", "local": "192.168.1.5", '
           '"scope": "global"}]}, {"ifname": "ib0", "flags": ["UP"], "addr_info": [{"family": "inet", '
           '"local": "10.1.2.3", "scope": "global"}]}]')


class FakeProbe(Probe):
    """The one seam replaced: commands answer from fixtures, PATH from a dict."""

    def __init__(self, sys_root: Path, answers: dict[str, str | None], path: dict[str, str]) -> None:
        super().__init__(sys_root=sys_root)
        self.answers, self.path, self.asked = answers, path, []

    def run(self, argv: Sequence[str]) -> str | None:
        self.asked.append(" ".join(argv))
        return self.answers.get(" ".join(argv[:3]))

    def which(self, name: str) -> str | None:
        return self.path.get(name)


def gpu_probe(tmp_path: Path, **path: str) -> FakeProbe:
    return FakeProbe(gpu_sysfs(tmp_path / "sys"), {
        "scontrol show partition": (SLURM / "scontrol_show_partition_gpu.txt").read_text(),
        "scontrol show node": (SLURM / "scontrol_show_node_gpu.txt").read_text(),
        "ip -j addr": IP_JSON, "podman info --format": "crun\n"}, path)


def no_questions(question: str, default: str, choices: Sequence[str]) -> str:
    raise AssertionError(f"asked {question!r}")


def test_sysfs_readers(tmp_path: Path) -> None:
    probe = gpu_probe(tmp_path)
    ports = {p.hca: p for p in hca_ports(probe)}
    assert ports["mlx5_0"].active and ports["mlx5_0"].link_layer == "InfiniBand"
    assert not ports["mlx5_2"].active and ports["mlx5_3"].roce_v2_gid == 3
    assert {(i.name, i.ipoib, i.up) for i in net_interfaces(probe)} >= {("ib0", True, True), ("eth0", False, True)}


def test_mi300_plan_from_a_gpu_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("hpcrl.runtimes.podman.rootless", lambda: True)
    env = {"HOME": str(tmp_path / "home"), "XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    parent = load_profile("mi300-cluster", env).profile
    facts = sitenew.gather(gpu_probe(tmp_path, podman="/usr/bin/podman", apptainer="/usr/bin/apptainer"))
    plan = sitenew.plan(facts, parent, sitenew.Flags(), no_questions)
    values = {k: v for k, (v, _) in plan.values.items()}
    assert values == {"slurm.partition": "mi300x", "slurm.time": "2-00:00:00",
                      "slurm.cpus_per_task": 176, "slurm.mem": "2250000M", "slurm.gpus_per_node": 8,
                      "slurm.gpu_memory_gib": 192, "container.runtime": "podman",
                      "network.interface": "ib0", "network.family": "auto"}
    assert plan.values["slurm.gpus_per_node"][1] == "scontrol show node: Gres=gpu:mi300x:8(S:0-1)"
    # only InfiniBand ports, by exact name; a RoCE-only GID is not proposed beside them
    assert plan.proposals["NCCL_IB_HCA"][0] == "=mlx5_0,mlx5_1"
    assert "NCCL_IB_GID_INDEX" not in plan.proposals
    assert any("rootless" in n and "keep-groups" in n for n in plan.notes), plan.notes

    text = sitenew.render("mycluster", "mi300-cluster", plan, host="login1", now=0)
    data = yaml.safe_load(text)
    assert "env" not in data and "NCCL_IB_HCA" not in str(data)  # proposed, never set
    assert '#   NCCL_IB_HCA: "=mlx5_0,mlx5_1"  # active ports:' in text
    for line in text.splitlines():
        if line.startswith("  ") and ":" in line:
            assert "  # " in line, f"a value without its source: {line}"
    sites = tmp_path / "cfg" / "hpcrl" / "sites"
    sites.mkdir(parents=True)
    (sites / "mycluster.yaml").write_text(text)
    p = load_profile("mycluster", env).profile
    assert (p.slurm.partition, p.slurm.gpus_per_node, p.network.interface) == ("mi300x", 8, "ib0")
    assert "NCCL_IB_HCA" not in p.env and p.container.group_add == ("video",)


def test_a_profile_of_the_other_vendor_is_named(tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path / "home"), "XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    parent = load_profile("h100-cluster", env).profile
    probe = gpu_probe(tmp_path, apptainer="/usr/bin/apptainer")
    plan = sitenew.plan(sitenew.gather(probe), parent, sitenew.Flags(), no_questions)
    assert any("GPUs here are amd's" in n and "extend mi300-cluster instead" in n for n in plan.notes), plan.notes


def test_roce_gid_and_apptainer_when_podman_is_absent(tmp_path: Path) -> None:
    probe = gpu_probe(tmp_path, apptainer="/opt/apptainer/bin/apptainer")
    for hca in ("mlx5_0", "mlx5_1"):  # only the RoCE port is left active
        (probe.sys_root / f"class/infiniband/{hca}/ports/1/state").write_text("1: DOWN\n")
    env = {"HOME": str(tmp_path / "home"), "XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    parent = load_profile("mi300-cluster", env).profile
    plan = sitenew.plan(sitenew.gather(probe), parent, sitenew.Flags(image="/scratch/hpcrl.sif"),
                        no_questions)
    values = {k: v for k, (v, _) in plan.values.items()}
    assert values["container.runtime"] == "apptainer" and values["container.gpu"] == "rocm"
    assert values["container.image"] == "/scratch/hpcrl.sif" and values["container.extra_flags"] == []
    assert plan.proposals["NCCL_IB_HCA"][0] == "=mlx5_3"
    assert plan.proposals["NCCL_IB_GID_INDEX"][0] == "3"


def test_no_terminal_takes_defaults_and_says_so(tmp_path: Path) -> None:
    """The command end to end, with `scontrol` and `podman` replaced by executables printing the
    fixtures (the seam is the executables), stdin not a terminal: it must not wait."""
    bin_ = tmp_path / "bin"
    write_exe(bin_ / "scontrol", "#!/bin/sh\ncase \"$2\" in partition) cat "
              f"{SLURM / 'scontrol_show_partition_gpu.txt'};; node) cat {SLURM / 'scontrol_show_node_gpu.txt'};; esac\n")
    write_exe(bin_ / "podman", "#!/bin/sh\necho crun\n")
    env = {"PATH": f"{bin_}:/usr/bin:/bin", "HOME": str(tmp_path / "home"),
           "XDG_CONFIG_HOME": str(tmp_path / "cfg"), "PYTHONPATH": str(REPO), "LANG": "C.UTF-8"}
    argv = [PYTHON, "-m", "hpcrl", "sites", "new", "gpu1"]
    proc = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, text=True, capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    # no `--extends`: every partition fits, the default one is taken, with a note
    assert "note: not a terminal, partition (cpu, mi300x): cpu" in proc.stderr
    written = tmp_path / "cfg" / "hpcrl" / "sites" / "gpu1.yaml"
    assert written.is_file() and "hpcrl doctor --site gpu1" in proc.stdout
    text = written.read_text()
    assert 'image: "localhost/hpcrl:latest"' in text
    # the profile never says it asked: each default taken is named as such, with its flag
    assert "asked" not in text
    assert "the default: no terminal to ask on (`--partition` chooses)" in text
    assert "the default: no terminal to ask on (`--image` chooses)" in text
    again = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, text=True, capture_output=True, timeout=60)
    assert again.returncode != 0 and "--force" in again.stderr
    with_flag = subprocess.run([*argv, "--extends", "mi300-cluster", "--force"], env=env,
                               stdin=subprocess.DEVNULL, text=True, capture_output=True, timeout=60)
    assert with_flag.returncode == 0, with_flag.stderr
    assert 'partition: "mi300x"' in written.read_text() and "not a terminal" not in with_flag.stderr


def test_a_failing_scontrol_is_noted_and_the_profile_still_loads(tmp_path: Path) -> None:
    """On a host whose Slurm is not configured, `scontrol` fails with a message of several lines
    (seen on the lab machine: `scontrol: error: fetch_config: DNS SRV lookup failed` and more); the
    note that records it stays one comment line, so the written profile is valid YAML."""
    bin_ = tmp_path / "bin"
    write_exe(bin_ / "scontrol", "#!/bin/sh\necho 'scontrol: error: resolve_ctls_from_dns_srv: res_nsearch error: "
              "Unknown host' >&2\necho 'scontrol: error: fetch_config: DNS SRV lookup failed' >&2\nexit 1\n")
    env = {"PATH": f"{bin_}:/usr/bin:/bin", "HOME": str(tmp_path / "home"),
           "XDG_CONFIG_HOME": str(tmp_path / "cfg"), "PYTHONPATH": str(REPO), "LANG": "C.UTF-8"}
    proc = subprocess.run([PYTHON, "-m", "hpcrl", "sites", "new", "noslurm", "--extends", "h100-cluster"],
                          env=env, stdin=subprocess.DEVNULL, text=True, capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "cfg" / "hpcrl" / "sites" / "noslurm.yaml").read_text()
    assert "# - `scontrol show partition --oneliner` failed (1): scontrol: error: resolve_ctls" in text
    # what could not be detected is said on stderr too, not only in the file's comments
    assert "note: `scontrol show partition --oneliner` failed (1): scontrol: error: resolve_ctls" in proc.stderr
    assert all(line.startswith("#") or not line.startswith("scontrol") for line in text.splitlines())
