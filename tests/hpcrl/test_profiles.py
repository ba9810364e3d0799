"""Site profiles: loading, extends chains, interpolation, search path, schema errors."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from hpcrl.profile_load import available_profiles, interpolate, load_profile, profile_from_dict
from hpcrl.profiles import (
    ProfileError,
    VersionEnvRule,
    env_for_ray_version,
    parse_time_minutes,
    profile_to_dict,
)
from tests.conftest import REPO, run_hpcrl

SHIPPED = ["h100-cluster", "local", "mi300-cluster", "mi300-cluster-apptainer", "slurmlab",
           "slurmlab-apptainer"]


def env_with(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {"HOME": str(tmp_path / "home"), "XDG_CONFIG_HOME": str(tmp_path / "cfg"), **extra}


def write_profile(directory: Path, name: str, text: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.yaml"
    path.write_text(textwrap.dedent(text))
    return path


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_profiles_load_and_round_trip(name: str, tmp_path: Path) -> None:
    loaded = load_profile(name, env_with(tmp_path))
    p = loaded.profile
    assert p.name == name and p.description
    assert profile_from_dict(profile_to_dict(p)) == p
    if p.scheduler == "slurm":
        assert p.container.image, "every Slurm site runs in a container"
    assert not p.container.privileged, "a shipped site names the devices and capabilities it needs"


def test_shipped_names_are_listed(tmp_path: Path) -> None:
    assert list(available_profiles(env_with(tmp_path))) == SHIPPED


def test_extends_merges_and_records_provenance(tmp_path: Path) -> None:
    loaded = load_profile("mi300-cluster-apptainer", env_with(tmp_path))
    p, prov = loaded.profile, loaded.provenance
    base = str(REPO / "site_profiles" / "mi300-cluster.yaml")
    child = str(REPO / "site_profiles" / "mi300-cluster-apptainer.yaml")
    assert loaded.chain == (base, child)
    assert p.container.runtime == "apptainer" and p.container.gpu == "rocm"
    assert prov["container.runtime"] == child
    assert p.env["NCCL_PROTO"] == "Simple" and prov["env.NCCL_PROTO"] == base
    assert p.slurm.gpus_per_node == 8 and prov["slurm.gpus_per_node"] == base
    assert p.container.image == f"{tmp_path}/home/images/hpcrl-rocm.sif"


def test_search_path_user_wins_in_order(tmp_path: Path) -> None:
    cfg_dir = tmp_path / "cfg" / "hpcrl" / "sites"
    first, second = tmp_path / "first", tmp_path / "second"
    write_profile(cfg_dir, "slurmlab", "extends: slurmlab\ndescription: from config\n")
    env = env_with(tmp_path)
    assert load_profile("slurmlab", env).profile.description == "from config"
    write_profile(second, "slurmlab", "extends: slurmlab\ndescription: from second\n")
    write_profile(first, "slurmlab", "extends: slurmlab\ndescription: from first\n")
    env["HPCRL_SITE_PATH"] = f"{first}:{second}"
    loaded = load_profile("slurmlab", env)
    assert loaded.profile.description == "from first"
    # a user file extending the same name refines the next one down the path, to the shipped one
    assert [Path(c).parent for c in loaded.chain] == [
        REPO / "site_profiles", cfg_dir, second, first]
    assert loaded.profile.slurm.partition == "debug"


def test_env_interpolation_default_and_error(tmp_path: Path) -> None:
    d = tmp_path / "sites"
    write_profile(d, "s", """\
        description: x
        run_root: ${env:SCRATCH:-/scratch/default}/runs
        container: {runtime: none}
        env:
          WHO: ${env:WHO_AM_I}
          LITERAL: keep ${SLURM_JOB_ID} as is
        """)
    env = env_with(tmp_path, HPCRL_SITE_PATH=str(d), WHO_AM_I="alice")
    p = load_profile("s", env).profile
    assert p.run_root == "/scratch/default/runs"
    assert p.env["WHO"] == "alice" and p.env["LITERAL"] == "keep ${SLURM_JOB_ID} as is"
    env["SCRATCH"] = "/fast"
    assert load_profile("s", env).profile.run_root == "/fast/runs"
    del env["WHO_AM_I"]
    with pytest.raises(ProfileError) as err:
        load_profile("s", env)
    msg = str(err.value)
    assert "`WHO_AM_I`" in msg and "s.yaml" in msg and "`env.WHO`" in msg
    assert "${env:WHO_AM_I:-VALUE}" in msg


def test_interpolate_rejects_malformed_and_unknown_sys() -> None:
    with pytest.raises(ProfileError, match="malformed"):
        interpolate("${env:BAD-NAME}", {})
    with pytest.raises(ProfileError, match="unknown reference"):
        interpolate("${sys:nope}", {})
    assert interpolate("a${env:X}b", {"X": "$(rm -rf /)"}) == "a$(rm -rf /)b"


@pytest.mark.parametrize("body, needles", [
    ("description: x\ncontainer: {runtime: none}\nslurmm: {}\n",
     ["unknown key `slurmm`", "valid keys", "slurm", "container", "env"]),
    ("description: x\ncontainer: {runtime: none, imagee: y}\n",
     ["unknown key `container.imagee`", "image", "binds"]),
    ("description: x\ncontainer: {runtime: none}\nslurm: {nodes: two}\n",
     ["`slurm.nodes`", "integer", "'two'"]),
    ("description: x\ncontainer: {runtime: none}\nslurm: {exclusive: 'yes'}\n",
     ["`slurm.exclusive`", "true/false"]),
    ("description: x\ncontainer: {runtime: podman}\n",
     ["`container.image`", "is missing", "podman"]),
    ("description: x\ncontainer: {runtime: lxc, image: i}\n",
     ["`container.runtime`", "one of", "apptainer"]),
    ("description: x\ncontainer: {runtime: none}\nenv: {OK: 1, 'BAD NAME': x}\n",
     ["`env`", "'BAD NAME'", "not a valid variable name"]),
    ("description: x\ncontainer: {runtime: none}\nenv: {FLAG: true}\n",
     ["`env.FLAG`", "quote it"]),
    ("description: x\ncontainer: {runtime: none}\nslurm: {signal: 'USR1; rm -rf ~'}\n",
     ["`slurm.signal`", "signal name"]),
    ("description: x\ncontainer: {runtime: none}\nslurm: {time: soon}\n",
     ["'soon'", "HH:MM:SS"]),
    ("description: x\ncontainer: {runtime: none}\nray: {version_env: [{min_versio: '2'}]}\n",
     ["unknown key", "min_versio", "min_version"]),
])
def test_bad_profile_one_clear_error(tmp_path: Path, body: str, needles: list[str]) -> None:
    d = tmp_path / "sites"
    path = write_profile(d, "bad", body)
    with pytest.raises(ProfileError) as err:
        load_profile("bad", env_with(tmp_path, HPCRL_SITE_PATH=str(d)))
    msg = str(err.value)
    assert str(path) in msg, msg
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_env_null_removes_inherited_and_extends_cycle(tmp_path: Path) -> None:
    d = tmp_path / "sites"
    write_profile(d, "child", "extends: slurmlab\nenv: {HPCRL_LAB_MARKER: null, NEW: v}\n")
    p = load_profile("child", env_with(tmp_path, HPCRL_SITE_PATH=str(d))).profile
    assert "HPCRL_LAB_MARKER" not in p.env and p.env["NEW"] == "v"
    assert p.env["PYTHONUNBUFFERED"] == "1"
    a = write_profile(d, "a", "extends: b\n")
    b = write_profile(d, "b", "extends: a\n")
    with pytest.raises(ProfileError) as err:
        load_profile("a", env_with(tmp_path, HPCRL_SITE_PATH=str(d)))
    assert str(err.value).startswith(f"site profile `a` extends itself: {a} -> {b} -> {a}")
    assert f"remove the `extends: a` of {b}" in str(err.value)
    me = write_profile(d, "me", "extends: me\n")
    with pytest.raises(ProfileError, match=f"`me` extends itself: {me} -> {me}"):
        load_profile("me", env_with(tmp_path, HPCRL_SITE_PATH=str(d)))


def test_a_user_profile_may_extend_the_shipped_one_of_its_name(tmp_path: Path) -> None:
    d = tmp_path / "sites"
    write_profile(d, "slurmlab", "extends: slurmlab\nslurm: {partition: mine}\n")
    p = load_profile("slurmlab", env_with(tmp_path, HPCRL_SITE_PATH=str(d))).profile
    assert p.slurm.partition == "mine" and p.container.runtime == "podman"


def test_unknown_profile_lists_known(tmp_path: Path) -> None:
    with pytest.raises(ProfileError) as err:
        load_profile("nope", env_with(tmp_path))
    assert "mi300-cluster" in str(err.value) and "HPCRL_SITE_PATH" in str(err.value)


def test_rocm_profile_lets_ray_set_each_workers_gpu(tmp_path: Path) -> None:
    # no RAY_EXPERIMENTAL_NOSET_* and no fixed device lists: the node exports the GPUs Slurm
    # granted, Ray gives each worker its own (hpcrl.devices)
    profile = load_profile("mi300-cluster", env_with(tmp_path)).profile
    assert profile.ray.version_env == ()
    assert not {"CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"} & set(profile.env)
    rules = (VersionEnvRule({"RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES": "1"}, min_version="2.45"),
             VersionEnvRule({"RAY_EXPERIMENTAL_NOSET_ROCR_VISIBLE_DEVICES": "1"}, below_version="2.45"))
    rocr = {"RAY_EXPERIMENTAL_NOSET_ROCR_VISIBLE_DEVICES": "1"}
    assert env_for_ray_version(rules, "2.44.1") == rocr and env_for_ray_version(rules, "2.10") == rocr
    assert env_for_ray_version(rules, "2.45.0") == env_for_ray_version(rules, "3.0.0.dev0") == {
        "RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES": "1"}


@pytest.mark.parametrize("text, minutes", [
    ("30", 30), ("1:30", 2), ("01:00:00", 60), ("24:00:00", 1440), ("1-00:00:00", 1440),
    ("2-12", 3600), ("0-00:10", 10), ("00:00:01", 1)])
def test_parse_time_minutes(text: str, minutes: int) -> None:
    assert parse_time_minutes(text) == minutes


def test_sites_cli_list_and_show(clean_env: dict[str, str]) -> None:
    listed = run_hpcrl(["sites"], clean_env)
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert [ln.split()[0] for ln in lines] == SHIPPED
    assert all(len(ln.split(None, 1)) == 2 for ln in lines)
    shown = run_hpcrl(["sites", "show", "mi300-cluster-apptainer"], clean_env)
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout
    child = str(REPO / "site_profiles" / "mi300-cluster-apptainer.yaml")
    base = str(REPO / "site_profiles" / "mi300-cluster.yaml")
    by_key = {ln.split(" = ")[0].strip(): ln for ln in out.splitlines() if " = " in ln}
    assert by_key["container.runtime"].endswith(f"# {child}")
    assert '"apptainer"' in by_key["container.runtime"]
    assert by_key["env.NCCL_PROTO"].endswith(f"# {base}")
    assert by_key["container.ipc_host"].endswith("# default")
    bad = run_hpcrl(["sites", "show", "nope"], clean_env)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "no site profile" in bad.stderr


# ----------------------------------------------------------------------------- bad numbers and names


def test_every_number_has_bounds() -> None:
    """Every int/float field of every section declares its range and the rule behind it."""
    import dataclasses
    import typing

    from hpcrl import profiles

    for cls in (profiles.SlurmConfig, profiles.ContainerConfig, profiles.NetworkConfig,
                profiles.RayConfig, profiles.AgentConfig, profiles.SiteProfile):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            inner = {a for a in typing.get_args(hints[f.name]) if a is not type(None)} or {hints[f.name]}
            if inner & {int, float} and bool not in inner:
                assert f.metadata["bounds"] and f.metadata["rule"], f"{cls.__name__}.{f.name}"


@pytest.mark.parametrize("section, key, value, shown", [
    ("slurm", "cpus_per_task", "-1", "from 1 to 100000 (CPUs of one node), got -1"),
    ("slurm", "signal_lead_s", "-100", "from 1 to 65535 (Slurm's `--signal` lead"),
    ("agent", "grace_s", ".nan", "from 0 to 3600 (a wait of up to an hour), got nan"),
    ("agent", "heartbeat_timeout_s", ".inf", "from 5 to 86400"),
    ("slurm", "nodes", "100000000000000000000000", "from 1 to 100000 (a Slurm node count)"),
    ("slurm", "nodes", "1e23", "must be a integer, got '1e23'"),
    ("slurm", "max_requeues", "-1", "from 0 to 10000"),
    ("ray", "port_base", "80", "from 1024 to 65535 (ports below 1024 are privileged), got 80"),
    ("ray", "num_gpus", "-2", "from 0 to 1024"),
])
def test_profile_numbers_are_range_checked(tmp_path: Path, section: str, key: str, value: str,
                                           shown: str) -> None:
    sites = tmp_path / "sites"
    path = write_profile(sites, "bad", f"""\
        extends: slurmlab
        {section}:
          {key}: {value}
        """)
    with pytest.raises(ProfileError) as raised:
        load_profile("bad", env_with(tmp_path, HPCRL_SITE_PATH=str(sites)))
    assert f"{path}: key `{section}.{key}`" in str(raised.value) and shown in str(raised.value)
    if "must be a number" in str(raised.value):
        assert f"Fix: set `{section}.{key}` within that range" in str(raised.value)



def test_command_line_numbers_are_range_checked_too(tmp_path: Path) -> None:
    from hpcrl.profile_load import replace_slurm

    lab = load_profile("slurmlab", env_with(tmp_path)).profile
    with pytest.raises(ProfileError, match=r"the command line: key `slurm.nodes` must be a number "
                       r"from 1 to 100000 \(a Slurm node count\), got 10000000"):
        replace_slurm(lab, nodes=10_000_000)


def test_signal_lead_is_checked_against_the_time_limit(tmp_path: Path) -> None:
    sites = tmp_path / "sites"
    write_profile(sites, "late", """\
        extends: slurmlab
        slurm: {time: "00:10:00", signal_lead_s: 600}
        """)
    with pytest.raises(ProfileError, match=r"`slurm.signal_lead_s` is 600 s, not less than the "
                       r"time limit `slurm.time` '00:10:00' \(600 s\).*requeue itself until "
                       r"`slurm.max_requeues`. Fix: a lead well below the time limit \(e.g. 60\)"):
        load_profile("late", env_with(tmp_path, HPCRL_SITE_PATH=str(sites)))
    from hpcrl.profile_load import replace_slurm

    lab = load_profile("slurmlab", env_with(tmp_path)).profile
    with pytest.raises(ProfileError, match="the command line: key `slurm.signal_lead_s` is 30 s"):
        replace_slurm(lab, time="0:30")  # `--time 0:30` under the lab's 30 s lead


def test_a_port_base_without_room_for_a_block_is_refused_at_load(tmp_path: Path) -> None:
    sites = tmp_path / "sites"
    write_profile(sites, "high", "extends: slurmlab\nray: {port_base: 65500}\n")
    with pytest.raises(ProfileError, match=r"key `ray.port_base` is 65500: port range "
                       r"65500..65536 cannot hold one block of 256.*Fix: a `ray.port_base` from "
                       r"1024 to 65280"):
        load_profile("high", env_with(tmp_path, HPCRL_SITE_PATH=str(sites)))


@pytest.mark.parametrize("name", ["../../x", "/etc/x", ".hidden", "a/b", ""])
def test_profile_names_are_checked_before_any_file_is_read(tmp_path: Path, name: str) -> None:
    sites = tmp_path / "a" / "b"
    sites.mkdir(parents=True)
    (tmp_path / "x.yaml").write_text("description: planted\n")  # what `../../x` would reach
    with pytest.raises(ProfileError, match=r"the site \(`--site`\) names .*, not a profile name"
                       r".*no file was read. Fix: pass a name `hpcrl sites` lists"):
        load_profile(name, env_with(tmp_path, HPCRL_SITE_PATH=str(sites)))
    write_profile(sites, "child", "extends: ../../x\n")
    with pytest.raises(ProfileError, match=r"`extends:` of .*child.yaml names '../../x'"):
        load_profile("child", env_with(tmp_path, HPCRL_SITE_PATH=str(sites)))
