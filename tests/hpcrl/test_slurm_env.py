from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpcrl.slurm_env import (
    HostListError,
    SlurmEnvError,
    compress_hostlist,
    expand_hostlist,
    job_context,
)


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("node[1-3]", ["node1", "node2", "node3"]),
        ("gpu-[01-04,07],cpu7", ["gpu-01", "gpu-02", "gpu-03", "gpu-04", "gpu-07", "cpu7"]),
        ("a[1-2]-b", ["a1-b", "a2-b"]),
        ("n[08-10]", ["n08", "n09", "n10"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("r[1-2]-n[01-02]", ["r1-n01", "r1-n02", "r2-n01", "r2-n02"]),
        ("login1", ["login1"]),
        ("x[3],y,z[001-002].cluster", ["x3", "y", "z001.cluster", "z002.cluster"]),
        (" node[1-2] ", ["node1", "node2"]),
    ],
)
def test_expand_examples(text: str, hosts: list[str]) -> None:
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("", "empty"),
        ("node[1-3", "unclosed"),
        ("node1-3]", "unmatched"),
        ("node[3-1]", "reversed"),
        ("node[a-b]", "range item"),
        ("node[]", "empty range"),
        ("a,,b", "empty entry"),
        ("n[[1]]", "nested"),
    ],
)
def test_expand_errors_name_the_problem(text: str, needle: str) -> None:
    with pytest.raises(HostListError, match=needle):
        expand_hostlist(text)


def test_compress_examples() -> None:
    assert compress_hostlist(["node1", "node2", "node3"]) == "node[1-3]"
    assert (
        compress_hostlist(["gpu-01", "gpu-02", "gpu-03", "gpu-04", "gpu-07", "cpu7"])
        == "gpu-[01-04,07],cpu7"
    )
    assert compress_hostlist(["a1-b", "a2-b"]) == "a[1-2]-b"
    assert compress_hostlist(["login"]) == "login"
    with pytest.raises(HostListError, match="cannot go into a host list"):
        compress_hostlist(["bad,name"])


_label = st.text(alphabet="abcxyz-.", min_size=1, max_size=4)
_host = (
    st.builds(
        lambda p, n, w, s: f"{p}{str(n).zfill(w)}{s}",
        _label,
        st.integers(0, 120),
        st.integers(1, 4),
        st.one_of(st.just(""), st.just("-b"), st.just(".x")),
    )
    | _label
)


@given(st.lists(_host, min_size=1, max_size=25))
def test_compress_then_expand_is_identity(hosts: list[str]) -> None:
    assert expand_hostlist(compress_hostlist(hosts)) == hosts


@given(
    st.text(alphabet="abn-", min_size=1, max_size=3),
    st.integers(0, 500),
    st.integers(0, 40),
    st.integers(1, 4),
)
def test_range_expansion_counts_and_padding(prefix: str, lo: int, span: int, width: int) -> None:
    hosts = expand_hostlist(f"{prefix}[{str(lo).zfill(width)}-{lo + span}]")
    assert len(hosts) == span + 1
    assert hosts[0] == f"{prefix}{str(lo).zfill(width)}"
    assert [int(h[len(prefix) :]) for h in hosts] == list(range(lo, lo + span + 1))
    assert all(len(h) - len(prefix) >= width for h in hosts)


# What a job step on the lab's node2 sees (second node of three, first run).
LAB_ENV = {
    "SLURM_JOB_ID": "42",
    "SLURM_JOB_NODELIST": "node[1-3]",
    "SLURM_JOB_NUM_NODES": "3",
    "SLURM_NODEID": "1",
    "SLURM_PROCID": "1",
}


def test_context_from_lab_env() -> None:
    ctx = job_context(LAB_ENV, hostname=lambda: "node2")
    assert ctx.job_id == "42"
    assert ctx.nodes == ("node1", "node2", "node3")
    assert ctx.node_rank == 1 and not ctx.is_head and ctx.hostname == "node2"
    assert ctx.restart == 0  # SLURM_RESTART_COUNT is unset on the first run
    assert ctx.end_time is None and not ctx.local
    assert ctx.array_job_id is None and ctx.array_task_id is None


def test_context_requeued_array_job_with_end_time() -> None:
    env = dict(
        LAB_ENV,
        SLURM_RESTART_COUNT="1",
        SLURM_ARRAY_JOB_ID="40",
        SLURM_ARRAY_TASK_ID="2",
        SLURM_JOB_END_TIME="1790000000",
    )
    ctx = job_context(env)
    assert ctx.restart == 1 and ctx.array_job_id == "40" and ctx.array_task_id == 2
    assert ctx.end_time == 1790000000.0


def test_context_end_time_seam_is_asked_only_without_the_variable() -> None:
    asked: list[str] = []

    def reader(job_id: str) -> float:
        asked.append(job_id)
        return 123.0

    assert job_context(LAB_ENV, end_time_reader=reader).end_time == 123.0
    assert asked == ["42"]


def test_local_context_without_slurm() -> None:
    ctx = job_context({}, hostname=lambda: "vm", new_job_id=lambda: "local-ab")
    assert ctx.local and ctx.job_id == "local-ab" and ctx.nodes == ("vm",)
    assert ctx.node_rank == 0 and ctx.is_head and ctx.restart == 0
    ctx2 = job_context({"HPCRL_JOB_ID": "j7", "HPCRL_RESTART": "2"}, hostname=lambda: "vm")
    assert ctx2.job_id == "j7" and ctx2.restart == 2 and ctx2.run == 2


def test_the_run_directory_index_is_the_one_the_job_script_claimed() -> None:
    """`RUN/<run>/` is `HPCRL_RESTART` (the batch script's claim of the next free index), not
    `SLURM_RESTART_COUNT`, which starts at 0 again for a job resumed with `--resume`; the
    restart count stays Slurm's (it bounds `max_requeues`)."""
    resumed = job_context(dict(LAB_ENV, SLURM_RESTART_COUNT="0", HPCRL_RESTART="3"))
    assert resumed.run == 3 and resumed.restart == 0
    requeued = job_context(dict(LAB_ENV, SLURM_RESTART_COUNT="1", HPCRL_RESTART="4"))
    assert requeued.run == 4 and requeued.restart == 1
    by_hand = job_context(dict(LAB_ENV, SLURM_RESTART_COUNT="2"))  # no job script's claim
    assert by_hand.run == by_hand.restart == 2


@pytest.mark.parametrize(
    ("update", "needle"),
    [
        ({"SLURM_NODEID": "3"}, "outside the 3 nodes"),
        ({"SLURM_NODEID": "x"}, "whole number"),
        ({"SLURM_JOB_NUM_NODES": "4"}, "inconsistent"),
        ({"SLURM_JOB_NODELIST": ""}, "SLURM_JOB_NODELIST"),
    ],
)
def test_context_errors(update: dict[str, str], needle: str) -> None:
    with pytest.raises((SlurmEnvError, HostListError), match=needle):
        job_context(dict(LAB_ENV, **update))
