"""Nodes failing mid-run on the Slurm lab, with the real trainer on three nodes, then two.

First the trainer's rank on a worker node is stopped (SIGSTOP, as a wedged rank sits: its node,
its agent and Ray stay alive, so only the trainer's progress watchdog can tell): the watchdog
names the rank and its node, with the other ranks' stacks, the run ends with that diagnosis and
the job is requeued without the node. Then, in the rerun, a worker node's network is cut (its link
goes down: slurmd, Ray and the trainer's rank lose every peer while its agent goes on beating
through the shared run directory, so only the GCS can tell); then, in the next rerun, the head
node dies (every process of the node: slurmd, its job steps, the agent, Ray and the trainer's
rank, killed at once). Each time the job is requeued with the node added to its `ExcNodeList`
(keeping the user's `--exclude`), and the rerun resumes from the newest complete checkpoint on a
spare node, or on one node fewer when none is left. The lost nodes are noticed by the surviving
agents (the first line of their logs that names the loss, stamped by the agent) within
`NOTICE_BOUND_S`, each by its own mechanism (the GCS for the cut, the heartbeat for the dead
head); Slurm itself keeps the requeued job `COMPLETING` until it marks a dead node down
(`SlurmdTimeout`, 300 s by default; 30 s in this lab), so the rerun starts after that."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from datetime import datetime
from pathlib import Path

import pytest

from hpcrl.diagnosis import read_diagnoses
from hpcrl.profiles import AgentConfig
from hpcrl.runstate import REQUEUE_DECIDED, REQUEUE_DONE, read_state
from tests.conftest import run_hpcrl, shows_stack
from tests.lab import FINISHED
from tests.lab.test_distributed import (
    expected_prompts,
    submit_fully_async,
    trained_prompts,
    write_sites,
)
from tests.lab.test_requeue import (
    assets,  # noqa: F401 - the module fixture: tiny model and toy task
    check_metrics,
    finished,
    logs,
    overrides,
    resumed_from,
    saved,
    sites,  # noqa: F401 - fixture
    submit,
    wait_for_step,
    write_site,
)
from trainer.metrics import read_jsonl

pytestmark = [pytest.mark.lab, pytest.mark.slow]

SLURMD_TIMEOUT = "30"
"""How long Slurm waits before it marks a silent node down (the lab's; real sites: 300 s)."""

WATCHDOG_S = 30
"""The watchdog's floor and least bound for this run (`trainer.watchdog.floor_s`, `min_s`; the
defaults, 600 s and 60 s, are for real models): a stopped rank is found this long after its call
began. Above the 10-14 s Ray takes to end the calls to a node cut off (its health checks), so
that the cut is seen as a lost node, not as a hang."""

HEARTBEAT_TIMEOUT_S = AgentConfig().heartbeat_timeout_s
"""The silence after which the agents count a node dead (the profile's default, 15 s: the lab's
site leaves it)."""

NOTICE_BOUND_S = 2 * HEARTBEAT_TIMEOUT_S
"""A lost node is noticed within two heartbeat timeouts of its loss: a dead node once its file has
been silent for `HEARTBEAT_TIMEOUT_S` (read once per `BEAT_S`), a cut-off one once Ray's health
checks drop it from the GCS (five missed checks 2 s apart, 10-14 s). Measured to the agent's own
log line that names the loss, not to the requeue decision: between the two the agent asks Slurm
(`scontrol show job`, `sinfo`), whose answers a busy machine delays by seconds."""


def noticed_at(run_dir: Path, restart: int, causes: tuple[str, ...], timeout: float = 30) -> float:
    """The time (the agent's clock) of the first line in run `restart`'s agent logs that contains
    one of `causes`: when a surviving agent noticed the loss."""
    deadline = time.monotonic() + timeout
    while True:
        stamps = [datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
                  for log in (run_dir / str(restart) / "logs").glob("agent-*.log")
                  for line in log.read_text(errors="replace").splitlines()
                  if any(cause in line for cause in causes)]
        if stamps:
            return min(stamps)
        if time.monotonic() > deadline:
            raise AssertionError(f"no agent of run {restart} logged any of {causes}\n{logs(run_dir)}")
        time.sleep(0.5)


def kill_node(lab, host: str, *, silent: bool) -> int:
    """Every process in `host`'s network namespace (slurmd, slurmstepd, srun on the batch host,
    the agent, Ray, the trainer) SIGKILLed at once: all stopped first (SIGSTOP, listed again
    until no new one appears), then killed. Returns how many there were.

    `silent` (the batch host, the head): its link goes down first, as a node that loses its
    power sends nothing as it dies. With its link up, the head's dying processes' closing
    sockets ended the surviving workers' step tasks within 3 s under load, their agents silent:
    both dead-head cases of `make test-fresh` at 4a1c4ff failed so (reproduced beside six busy
    loops: a worker's slurmstepd "Failed to send MESSAGE_TASK_EXIT: Connection refused" 2.4 s
    after the head's sockets closed). Killed one by one with its link up, the batch host's srun
    reported its agent's death and `--kill-on-bad-exit` ended the step instead (36c2ee9).

    Not silent (a worker): its link stays up, so its Ray peers hear of the death at once and the
    trainer names the dead rank itself (a crash whose sockets close, as a killed process tree's
    do); a worker that vanishes without a word is `cut_network`'s case."""
    ns = next(h.netns for h in lab.cfg.compute if h.name == host)
    if silent:
        subprocess.run(["ip", "-n", ns, "link", "set", "eth0", "down"], check=True)
    stopped: set[int] = set()
    while True:
        pids = {int(p) for p in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True,
                                               check=True).stdout.split()} - stopped
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass
        stopped |= pids
    for pid in stopped:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(stopped)


def cut_network(lab, host: str) -> None:
    """Take `host`'s only link down: its processes live on, cut off from every other node."""
    ns = next(h.netns for h in lab.cfg.compute if h.name == host)
    subprocess.run(["ip", "-n", ns, "link", "set", "eth0", "down"], check=True)


def node_loss(run_dir: Path, restart: int, timeout: float = 60) -> tuple[dict, dict]:
    """The requeue decision and the requeue of run `restart` after a node loss."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = read_state(run_dir, restart)
        decided = [r for r in rows if r["event"] == REQUEUE_DECIDED and r.get("lost_nodes")]
        done = [r for r in rows if r["event"] == REQUEUE_DONE]
        if decided and done:
            return decided[0], done[0]
        time.sleep(0.2)
    raise AssertionError(f"no requeue after the node loss in run {restart}\n{logs(run_dir)}")


def stop_rank(run_dir: Path, node: str) -> dict:
    """SIGSTOP the trainer's rank on `node` (its process, from `workers.json`; Ray numbers the ranks
    in its own order, not the job's nodes'), as a rank wedged in a collective sits; returns its
    entry (`rank`, `hostname`, `pid`)."""
    ranks = json.loads((run_dir / "workers.json").read_text())["actor_rollout_ref"]
    victim = next(r for r in ranks if r["hostname"] == node)
    os.kill(victim["pid"], signal.SIGSTOP)
    return victim


def check_hang(lab, job: int, run_dir: Path, victim: dict, stopped_at: float) -> float:
    """The hang diagnosis of the stopped rank `victim` (node, state, bound, the others' stacks), as
    `hpcrl status` shows it; returns the seconds from the stop to the diagnosis."""
    hangs = [d for d in read_diagnoses(run_dir) if d["kind"] == "hang"]
    assert len(hangs) == 1, (read_diagnoses(run_dir), logs(run_dir))
    hang = hangs[0]
    node, stopped = victim["hostname"], victim["rank"]
    assert hang["suspect_nodes"] == [node], hang
    assert f"rank {stopped} on node `{node}` (pid {victim['pid']}, stopped (T))" in hang["summary"], hang["summary"]
    ranks = {r["rank"]: r for r in hang["ranks"]}
    assert (ranks[stopped]["node"], ranks[stopped]["state"], ranks[stopped]["answered"]) == (node, "T", False), hang
    # the floor (the call's first durations) or the learned bound, at least `min_s`
    assert hang["bound_s"] >= WATCHDOG_S and ("`trainer.watchdog.floor_s`" in hang["bound"]
                                              or f"at least {WATCHDOG_S} s" in hang["bound"]), hang
    detected = hang["time"] - stopped_at
    # fired at the bound after the call began (at most the bound after the stop), then poll, states, stacks
    assert 0 < detected < hang["bound_s"] + 90, f"{detected:.1f} s from the stop to the hang diagnosis"
    assert hang["elapsed_s"] >= hang["bound_s"], hang
    for rank in set(ranks) - {stopped}:  # the others' stacks, written before their group was ended
        assert ranks[rank]["state"] in ("R", "S"), hang
        stack = Path(ranks[rank]["stack"]).read_text()[ranks[rank]["stack_offset"]:]
        assert shows_stack(stack), (rank, stack)  # py-spy's, or faulthandler's on the signal
    # the flight recorder: a stopped rank runs no thread; the others dump gloo's recorder across the nodes
    assert ranks[stopped]["nccl_trace_note"] == "the rank is stopped (T): none of its threads runs", hang
    for rank in set(ranks) - {stopped}:
        assert Path(ranks[rank]["nccl_trace"]).is_file() and "gloo's flight recorder" in ranks[rank]["nccl_trace_note"], hang
    assert all("no GPU tools on" in e["notes"][0] and not e["suspect"] for e in hang["gpu"].values()), hang["gpu"]
    if ranks[stopped]["stack_by"] == "py-spy":  # read from the stopped process's memory, no handler needed
        stack = Path(ranks[stopped]["stack"]).read_text()[ranks[stopped]["stack_offset"]:]
        assert shows_stack(stack), stack
    status = run_hpcrl(["status", str(run_dir)], lab.env)
    assert "diagnosis (hang," in status.stdout and f"rank {stopped} on node `{node}`" in status.stdout, (
        status.stdout + status.stderr)
    agent_log = next((run_dir / "0" / "logs").glob("agent-0-*.log")).read_text()
    assert f"the trainer's watchdog blamed node(s) {node}" in agent_log, agent_log[-3000:]
    return detected


def test_a_stopped_rank_then_a_cut_off_worker_then_a_dead_head_requeue_on_spares_then_on_one_node_fewer(
        lab_manager, sites, assets, tmp_path):  # noqa: F811 - fixtures
    """A 3-node job that may run on 2 (`slurm.min_nodes: 2`) on a lab of 6 nodes, one excluded
    by the user: run 0 on 3 nodes has the rank on its second node stopped (the watchdog's
    diagnosis blames the node) and resumes on a spare; run 1 loses a worker (network cut) and
    resumes on the last spare; run 2 loses its head and, with no spare left, resumes on the 2
    survivors with a world of 2 ranks from the checkpoint 3 ranks wrote."""
    lab = lab_manager.get(nodes=6, extra={"SlurmdTimeout": SLURMD_TIMEOUT})
    try:
        write_site(sites, "nodefail", tmp_path / "runs", nodes=3, slow_s=0.25, slow_runs="0,1,2")
        site = sites / "nodefail.yaml"  # with the user's own exclusion, kept through every requeue
        site.write_text(site.read_text().replace(
            "slurm:\n", "slurm:\n  min_nodes: 2\n  extra_sbatch: ['--exclude=node5']\n"))
        run_dir = tmp_path / "runs" / "nodefail"
        args = [a.replace("=4", "=6") if "batch_size" in a else a  # splits over 3 and 2 ranks
                for a in overrides(assets, steps=16, save_freq=2)]
        args += [f"trainer.watchdog.floor_s={WATCHDOG_S}", f"trainer.watchdog.min_s={WATCHDOG_S}",
                 "trainer.watchdog.poll_s=1"]
        job = submit(lab, sites, "nodefail", run_dir, args)
        placed, noticed, figures = [], [], {}
        for restart, rank, how in ((0, 1, "stop"), (1, 1, "cut"), (2, 0, "kill")):
            wait_for_step(lab, job, run_dir, restart, (restart + 1) * 4 - 1, timeout=400)
            nodes = lab.run("scontrol", "show", "hostnames", lab.job(job)["NodeList"]).stdout.split()
            assert len(nodes) == 3, nodes
            placed.append(nodes)
            victim = nodes[rank]
            t0 = time.time()
            if how == "stop":
                stopped = stop_rank(run_dir, victim)
            elif how == "cut":
                cut_network(lab, victim)
            else:
                assert kill_node(lab, victim, silent=True) > 0  # the head
            # an upper bound, not an expectation: at a load of 40 (make test-fresh beside helper lab runs)
            # the dead head took over 60 s to be noticed; quiet, 17-32 s (bench/README.md)
            decided, done = node_loss(run_dir, restart, timeout=150)
            assert decided["lost_nodes"] == [victim], decided
            noticed.append(decided["time"] - t0)
            if how == "stop":
                assert f"node `{victim}` holds a stuck rank" in decided["message"], decided
                figures["diagnosed"] = check_hang(lab, job, run_dir, stopped, t0)
                figures["requeued"] = done["time"] - t0
            else:  # the mechanism that must notice it, named in the agent's log and the message
                cut = how == "cut"
                # the head's GCS watch, or its check of the nodes after the payload failed first
                causes = ((f"Ray on node `{victim}` (rank ", f"node(s) {victim} left the Ray cluster")
                          if cut else (f"the head `{victim}` stopped its heartbeat",))
                seen = noticed_at(run_dir, restart, causes) - t0
                assert (f"node `{victim}` was cut off (it left the Ray cluster while its agent beat on)"
                        if cut else f"node `{victim}` died") in decided["message"], decided
                assert 0 < seen < NOTICE_BOUND_S, (
                    f"{seen:.1f} s to notice that {victim} failed (bound {NOTICE_BOUND_S:.0f} s)\n{logs(run_dir)}")
                figures[how] = seen
            assert "set `ExcNodeList=" in done["message"], done
            shrunk = "and `NumNodes=2-2 NumTasks=2 NumCPUs=" in done["message"]
            assert shrunk == (restart == 2), done  # no spare left the third time
            newest = max(saved(run_dir, restart))
            wait_for_step(lab, job, run_dir, restart + 1, newest + 1, timeout=300)
            assert resumed_from(run_dir, restart + 1) == newest, logs(run_dir)
            if how == "stop":
                figures["resumed"] = time.time() - t0  # its first step logged (polled every 0.2 s)
                assert victim in lab.job(job)["ExcNodeList"].split(","), lab.job(job)
        rec = finished(lab, job, run_dir)
        assert rec["JobState"] == "COMPLETED" and rec["Restarts"] == "3", (rec, logs(run_dir))
        lost = [placed[0][1], placed[1][1], placed[2][0]]
        assert rec["ExcNodeList"] == ",".join(["node5", *lost]), rec
        last = lab.run("scontrol", "show", "hostnames", rec["NodeList"]).stdout.split()
        assert len(last) == 2 and not set(last) & {"node5", *lost}, (last, lost)
        agent_log = next((run_dir / "3" / "logs").glob("agent-0-*.log")).read_text()
        assert agent_log.count("job asked for 3 nodes, the allocation has 2; using 2") == 1
        payload_log = (run_dir / "3" / "logs" / "payload.log").read_text()
        assert "(saved on 3 rank(s)) on 2 rank(s)" in payload_log, payload_log[-2000:]
        assert "trainer.nnodes=${oc.env:HPCRL_NUM_NODES}" in agent_log
        check_metrics(run_dir, 16)
        print(f"the stopped rank diagnosed after {figures['diagnosed']:.1f} s, the job requeued after "
              f"{figures['requeued']:.1f} s, its first step resumed after {figures['resumed']:.1f} s; "
              f"noticed the cut-off worker after {figures['cut']:.1f} s (requeue decided after "
              f"{noticed[1]:.1f} s), the dead head after {figures['kill']:.1f} s ({noticed[2]:.1f} s); "
              f"the last run had {len(last)} nodes")
    finally:
        lab_manager.discard()  # one of its nodes is cut off, one dead


def test_a_dead_rollout_node_in_a_fully_async_run_requeues_on_the_spare_and_trains_every_prompt_once(
        lab_manager, sites, tmp_path):  # noqa: F811 - fixtures
    """verl's fully-async loop on 2 nodes of a 3-node lab (the trainer's rank on one, the rollout
    pool's on the other, wherever Ray put them; the third a spare), checkpointing every step:
    after step 2 is saved, while the pool generates ahead, the pool's node dies (every process of
    it killed, as the head above). On the worker node, the trainer's rollouter loses its pool rank
    and the run ends naming the rank dead; on the head, the trainer dies with it and the worker's
    agent finds the head silent. Either way the job is requeued without the node, resumes from
    the newest checkpoint on the spare and finishes, and every prompt of the run is trained
    exactly as often as in an unbroken run."""
    from trainer.rewards.toy import write_toy_digits
    from trainer.tiny import save_tiny

    shared = tmp_path / "shared"
    save_tiny(shared / "model", seed=0)
    write_toy_digits(shared / "data", train_size=512, val_size=16, seed=0)
    write_sites(sites, shared)
    lab = lab_manager.get(nodes=3, extra={"SlurmdTimeout": SLURMD_TIMEOUT})
    try:
        run_dir, job = submit_fully_async(lab, sites, shared, save_freq=1)
        wait_for_step(lab, job, run_dir, 0, 2, timeout=400)
        deadline = time.monotonic() + 60
        while 2 not in saved(run_dir, 0):  # its checkpoint, written while the pool generates ahead
            assert time.monotonic() < deadline and lab.state(job) not in FINISHED, logs(run_dir)
            time.sleep(0.2)
        nodes = lab.run("scontrol", "show", "hostnames", lab.job(job)["NodeList"]).stdout.split()
        layout = json.loads((shared / "fa" / "workers.json").read_text())
        (trainer_node,), (pool_node,) = ({w["hostname"] for w in layout[g]} for g in ("actor_rollout_ref", "rollout"))
        assert trainer_node != pool_node and {trainer_node, pool_node} == set(nodes), (layout, nodes)
        head = pool_node == nodes[0]  # the trainer's driver runs on the head: it dies with the pool
        t0 = time.time()
        assert kill_node(lab, pool_node, silent=head) > 0
        decided, done = node_loss(run_dir, 0, timeout=120)
        assert decided["lost_nodes"] == [pool_node] and f"node `{pool_node}` died" in decided["message"], decided
        causes = ((f"the head `{pool_node}` stopped its heartbeat",) if head else
                  ("checking whether nodes died with it",))  # the head agent's first line on a failure
        seen = noticed_at(run_dir, 0, causes) - t0
        assert 0 < seen < NOTICE_BOUND_S, f"{seen:.1f} s to notice that {pool_node} died\n{logs(run_dir)}"
        trainer_seen = None
        if not head:  # the trainer itself named the dead pool rank (its diagnosis, as `hpcrl status` shows it)
            failures = [d for d in read_diagnoses(shared / "fa") if d["time"] >= t0]
            assert failures and f"on node `{pool_node}`" in failures[0]["summary"], (failures, logs(run_dir))
            assert "died" in failures[0]["summary"], failures
            trainer_seen = failures[0]["time"] - t0
        assert max(saved(run_dir, 0)) == 2, logs(run_dir)
        wait_for_step(lab, job, run_dir, 1, 3, timeout=300)
        assert resumed_from(run_dir, 1) == 2, logs(run_dir)
        resumed = time.time() - t0
        rec = finished(lab, job, run_dir, timeout=600)
        assert rec["JobState"] == "COMPLETED" and rec["Restarts"] == "1", (rec, logs(run_dir))
        assert rec["ExcNodeList"] == pool_node, rec
        last = lab.run("scontrol", "show", "hostnames", rec["NodeList"]).stdout.split()
        spare = ({"node1", "node2", "node3"} - set(nodes)).pop()
        assert sorted(last) == sorted({*nodes, spare} - {pool_node}), (last, nodes)
        rows = read_jsonl(shared / "fa" / "metrics.jsonl")
        assert [r["step"] for r in rows] == [1, 2, 3, 4, 5], rows
        assert trained_prompts(shared, 5) == expected_prompts(shared, 60, 8)
        status = run_hpcrl(["status", str(run_dir)], lab.env)
        assert f"node `{pool_node}` died" in status.stdout, status.stdout + status.stderr
        print(f"the rollout node {pool_node} ({'the head' if head else 'a worker'}) killed after step 2: "
              + (f"the trainer named its dead pool rank after {trainer_seen:.1f} s, " if trainer_seen else "")
              + f"the agents noticed after {seen:.1f} s, the requeue decided after {decided['time'] - t0:.1f} s, "
              f"done after {done['time'] - t0:.1f} s; resumed from step 2 on {last} (its step 3 logged after "
              f"{resumed:.1f} s)")
    finally:
        lab_manager.discard()  # one of its nodes is dead
