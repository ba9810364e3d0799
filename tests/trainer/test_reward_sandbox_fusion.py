"""Code rewards through SandboxFusion (`reward_model.sandbox_fusion.*`): verl's three spellings of
the keys read as one config; each response's code run on its test cases by a real `run_code`
service on loopback (`tests/trainer/sandbox_fusion_server.py`, which runs the code), scored as
verl 0.9.1's own `compute_score` scores it against the same service, with the same requests; the
bound on requests in flight; a dead, refusing or silent service fails naming the URL and the fix."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest

from tests.trainer.sandbox_fusion_server import SandboxFusionServer
from tests.trainer.test_driver import toy_overrides
from tests.verl_env import verl_python
from trainer.config import load_config
from trainer.config.base import ConfigError
from trainer.rewards import RewardError, default_compute_score
from trainer.rewards.sandbox_fusion import (
    SandboxFusionError,
    SandboxScorer,
    _post_run_code,
    check_correctness,
)
from trainer.stages.reward import load_reward

ADD = {"inputs": ["1 2\n", "3 4\n", "10 -3\n"], "outputs": ["3\n", "7\n", "7\n"]}
CASES: list[tuple[str, object]] = [
    ("```python\na, b = map(int, input().split())\nprint(a + b)\n```", ADD),  # all pass
    ("Here:\n```python\nprint(3)\n```", json.dumps(ADD)),  # the first case only; JSON text
    ("```\npython\na, b = map(int, input().split())\nprint(a - b)\n```", ADD),  # fenced, language line
    ("```python\nraise SystemExit(1)\n```", ADD),  # runtime error
    ("no code at all", ADD),
    ("```python\ndef add(a, b):\n    return a + b\n```",
     {"fn_name": "add", "inputs": ["1\n2", "[1]\n[2]"], "outputs": ["3", "[1, 2]"]}),
    ("```python\nclass Solution:\n    def twice(self, x):\n        return 2 * x\n```",
     {"fn_name": "twice", "inputs": ["4", "\"ab\""], "outputs": ["8", "abab"]}),
    ("```python\ndef sq(x):\n    return x * x\n```", {"assert_case": ["assert sq(3) == 9", "assert sq(2) == 5"]}),
    ("```python\nprint(1)\n```", {"inputs": ["", ""], "outputs": ["1"]}),  # count mismatch
    ("```python\nprint(1)\n```", {"outputs": ["1"]}),  # no inputs
]

VERL_SIDE = """
import json, sys, threading
from verl.utils.reward_score import default_compute_score
spec = json.loads(sys.stdin.read())
gate = threading.Semaphore(spec["max_concurrent"])
print(json.dumps([default_compute_score(source, text, truth, None, sandbox_fusion_url=spec["url"],
                                        concurrent_semaphore=gate, memory_limit_mb=spec["memory_limit_mb"])
                  for source, text, truth in spec["rows"]]))
"""


def free_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/run_code"  # closed again: nothing listens


# ------------------------------------------------------------------------------ config

def test_verls_three_spellings_give_one_config() -> None:
    url = "http://127.0.0.1:8080/run_code"
    b178 = load_config([f"reward_model.sandbox_fusion.url={url}", "reward_model.sandbox_fusion.max_concurrent=8",
                        "reward_model.sandbox_fusion.memory_limit_mb=512"], env={})
    new = load_config([f"reward.sandbox_fusion.url={url}", "reward.sandbox_fusion.max_concurrent=8",
                       "reward.sandbox_fusion.memory_limit_mb=512"], env={})
    top = load_config([f"sandbox_fusion.url={url}", "sandbox_fusion.max_concurrent=8",
                       "sandbox_fusion.memory_limit_mb=512"], env={})
    assert b178 == new == top
    assert (b178.reward_model.sandbox_fusion.url, b178.reward_model.sandbox_fusion.max_concurrent) == (url, 8)
    assert load_config([], env={}).reward_model.sandbox_fusion.url is None


@pytest.mark.parametrize(("items", "says"), [
    (["reward_model.sandbox_fusion.url=localhost:8080"], "must be the SandboxFusion service's `run_code` URL"),
    (["reward_model.sandbox_fusion.max_concurrent=0"], "must be 1 or more"),
    (["reward_model.sandbox_fusion.url=http://h/run_code", "custom_reward_function.path=/f.py"],
     "`custom_reward_function.reward_kwargs.sandbox_fusion_url=...`"),
    (["reward.sandbox_fusion.url=http://h/run_code", "reward_model.sandbox_fusion.url=http://g/run_code"],
     "Fix: keep one of them"),
])
def test_bad_sandbox_settings_are_refused(items: list[str], says: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(items, env={})
    assert says in str(err.value)


def test_code_without_a_sandbox_is_refused_naming_the_key() -> None:
    with pytest.raises(RewardError, match=r"reward_model.sandbox_fusion.url=http://HOST:PORT/run_code"):
        default_compute_score("codecontests", "```python\nprint(1)\n```", ADD)


# ------------------------------------------------------------------------------ against verl

def test_scores_and_requests_are_verls_on_a_real_service(tmp_path: Path) -> None:
    python = verl_python()
    rows = [("codecontests" if i % 2 else "taco", text, truth) for i, (text, truth) in enumerate(CASES)]
    with SandboxFusionServer().running() as server:
        cfg = load_config([f"reward.sandbox_fusion.url={server.url}", "reward.sandbox_fusion.memory_limit_mb=512"],
                          env={})
        fn = load_reward(cfg)
        ours = [fn(data_source=s, solution_str=t, ground_truth=json.loads(json.dumps(g)), extra_info=None)
                for s, t, g in rows]
        our_requests = list(server.requests)
        server.requests.clear()
        spec = {"url": server.url, "max_concurrent": 64, "memory_limit_mb": 512, "rows": rows}
        done = subprocess.run([python, "-c", VERL_SIDE], input=json.dumps(spec), capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": ""}, timeout=600, check=False)
        their_requests = list(server.requests)
    assert done.returncode == 0, f"verl's side failed:\n{done.stderr[-4000:]}"
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    assert ours == theirs
    assert ours[:5] == [1.0, pytest.approx(1 / 3), 0.0, 0.0, 0.0] and ours[5:8] == [1.0, 1.0, 0.5]
    assert sorted(map(json.dumps, our_requests)) == sorted(map(json.dumps, their_requests))
    assert {r["memory_limit_MB"] for r in our_requests} == {512}
    assert {(r["compile_timeout"], r["run_timeout"]) for r in our_requests} == {(10, 10)}


def test_requests_in_flight_stay_within_max_concurrent() -> None:
    slow = "```python\nimport time\ntime.sleep(0.3)\nprint(input())\n```"  # a sleep pacing the load
    cases = {"inputs": [f"{i}\n" for i in range(8)], "outputs": [f"{i}\n" for i in range(8)]}
    with SandboxFusionServer().running() as server:
        scorer = SandboxScorer(server.url, max_concurrent=2, memory_limit_mb=256)
        assert scorer(slow, cases) == 1.0
    assert len(server.requests) == 8 and 1 <= server.most_in_flight <= 2


def test_a_run_past_its_time_limit_fails_its_case() -> None:
    """The service's `TimeLimitExceeded` (verl's -3): here with a 1 s limit (verl's is 10 s)."""
    import threading

    with SandboxFusionServer().running() as server:
        results = check_correctness(server.url, {"inputs": ["\n", "\n"], "outputs": ["1", "1"]},
                                    "import time, sys\nif sys.stdin.read() == '\\n':\n    time.sleep(30)\nprint(1)",
                                    1024, threading.Semaphore(2), timeout=1)
    assert results == [-3, -3] and {r["run_timeout"] for r in server.requests} == {1}


# ------------------------------------------------------------------------------ a service that fails

def test_a_dead_service_fails_naming_the_url_and_the_fix() -> None:
    url = free_port_url()
    cfg = load_config([f"reward_model.sandbox_fusion.url={url}"], env={})
    with pytest.raises(SandboxFusionError) as err:
        load_reward(cfg)(data_source="apps", solution_str="```python\nprint(1)\n```", ground_truth=ADD)
    assert f"`{url}`" in str(err.value) and "Fix: start the service" in str(err.value)


def test_a_gateway_timeout_is_tried_three_times_then_fails() -> None:
    with SandboxFusionServer(mode="504").running() as server:
        with pytest.raises(SandboxFusionError, match="HTTP 504"):
            SandboxScorer(server.url, 4, 1024)("```python\nprint(1)\n```", {"inputs": ["\n"], "outputs": ["1"]})
    assert len(server.requests) == 3


def test_a_silent_service_fails_at_the_request_timeout() -> None:
    """verl's request timeout is `2 * 10 + 10` s; the same path with 0.5 s."""
    import threading

    with SandboxFusionServer(mode="hang").running() as server:
        with pytest.raises(SandboxFusionError, match=server.url):
            check_correctness(server.url, {"inputs": ["\n"], "outputs": ["1"]}, "print(1)", 1024,
                              threading.Semaphore(1), post=lambda url, payload, _: _post_run_code(url, payload, 0.5))


class FencedTokenizer:
    """The tiny model writes no code: its responses decode to one fenced block (the decoding seam)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "```python\na, b = map(int, input().split())\nprint(a + b)\n```"


def test_the_reward_stage_scores_code_rows_and_fails_on_a_dead_service(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The reward stage over a generated batch of code rows: scored through the service (all
    pass; the rows' requests sent together, as verl's reward loop runs its rows), and with nothing
    listening at the URL the stage raises naming it (the step fails)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from trainer.driver import PPODriver
    from trainer.rewards.toy import write_toy_digits
    from trainer.stages.reward import RuleRewardEngine

    data = tmp_path / "data"
    write_toy_digits(data, train_size=8, val_size=4, seed=0)
    for name in ("train", "test"):
        rows = pq.read_table(data / f"{name}.parquet").to_pylist()
        for row in rows:
            row["data_source"] = "codecontests"
            row["reward_model"] = {**row["reward_model"], "ground_truth": json.dumps(ADD)}
        pq.write_table(pa.Table.from_pylist(rows), data / f"{name}.parquet")
    common = ("data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4")
    with SandboxFusionServer(hold_until=6).running() as server:  # 2 rows' cases at once, at least
        cfg = load_config(toy_overrides(tiny_model_dir, data, tmp_path / "run", *common,
                                        f"reward.sandbox_fusion.url={server.url}"))
        driver = PPODriver(cfg)
        batch = driver.generate(driver.loader.next_batch())
        RuleRewardEngine(cfg, FencedTokenizer()).score(batch)
        assert batch.sequence_scores.tolist() == [1.0] * len(batch)
        assert len(server.requests) == 3 * len(batch) and server.most_in_flight >= 6  # rows scored together
    url = free_port_url()
    dead = RuleRewardEngine(load_config(toy_overrides(tiny_model_dir, data, tmp_path / "run2", *common,
                                                      f"reward.sandbox_fusion.url={url}")), FencedTokenizer())
    with pytest.raises(SandboxFusionError, match=url):
        dead.score(batch)


def test_the_prime_manager_keeps_the_bound_over_its_processes_and_fails_on_a_dead_service() -> None:
    """verl's sandbox example scores with `prime` (forked processes): the requests in flight stay
    within `max_concurrent` over all of them, and a dead service fails the step (prime scores
    other failures 0)."""
    from trainer.rewards.prime import score_prime

    slow = "```python\nimport time\ntime.sleep(0.2)\nprint(input())\n```"  # a sleep pacing the load
    cases = json.dumps({"inputs": ["1\n", "2\n"], "outputs": ["1\n", "2\n"]})
    with SandboxFusionServer().running() as server:
        fn = load_reward(load_config([f"reward_model.sandbox_fusion.url={server.url}", "reward_model.reward_manager=prime",
                                      "reward_model.sandbox_fusion.max_concurrent=3"], env={}))
        scores = score_prime(fn, ["apps"] * 6, [slow] * 6, [cases] * 6, [None] * 6)
    assert scores == [1.0] * 6 and len(server.requests) == 12 and 1 <= server.most_in_flight <= 3
    url = free_port_url()
    fn = load_reward(load_config([f"reward_model.sandbox_fusion.url={url}", "reward_model.reward_manager=prime"], env={}))
    with pytest.raises(SandboxFusionError, match=url):
        score_prime(fn, ["apps"] * 2, [slow] * 2, [cases] * 2, [None] * 2)
