"""A generative reward model: the reward function receives `reward_router_address` and
`reward_model_tokenizer` as verl 0.9.1 passes them and scores through the server at that address;
a dead or timing-out server fails the step naming the address, and nothing of the step is logged
or saved. The server process is the one faked seam (`trainer.rewards.server.launch_server`): a
small OpenAI-compatible HTTP server started here."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.trainer.test_driver import toy_overrides
from tests.trainer.test_reward_model import tiny_rm_dir  # noqa: F401 (a fixture)
from trainer.config import load_config
from trainer.driver import PPODriver
from trainer.metrics import read_jsonl
from trainer.rewards import server as server_mod
from trainer.rewards.server import RewardServerError
from trainer.rewards.toy import write_toy_digits

REWARD = '''
import json, urllib.request

def compute_score(data_source, solution_str, ground_truth, extra_info=None,
                  reward_router_address=None, reward_model_tokenizer=None):
    assert reward_model_tokenizer is not None and reward_model_tokenizer.eos_token == "</s>"
    body = {"model": "rm", "messages": [{"role": "user", "content": solution_str}]}
    request = urllib.request.Request(f"http://{reward_router_address}/v1/chat/completions",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=2) as resp:
        answer = json.loads(resp.read())["choices"][0]["message"]["content"]
    return float(answer)
'''


class FakeRM:
    """An OpenAI-compatible chat server whose verdict is the response's length / 10; it can die
    after `die_after` chats (its process status turns to 1)."""

    def __init__(self, port: int, die_after: int | None = None) -> None:
        self.chats: list[str] = []
        self.exit_code: int | None = None
        self.release = threading.Event()
        rm = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802
                self._send({}) if self.path == "/health" else self.send_error(404)

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                text = body["messages"][-1]["content"]
                rm.chats.append(text)
                if die_after is not None and len(rm.chats) >= die_after:
                    rm.exit_code = 1
                self._send({"choices": [{"message": {"role": "assistant", "content": str(len(text) / 10)}}]})

        self.http = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)
        self.thread.start()

    def poll(self) -> int | None:
        return self.exit_code

    def terminate(self) -> None:
        self.release.set()
        self.http.shutdown()
        self.http.server_close()
        self.exit_code = self.exit_code if self.exit_code is not None else -15

    def wait(self, timeout: float | None = None) -> int:
        self.thread.join(timeout)
        return int(self.exit_code or 0)


@pytest.fixture
def fake_rm(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    made: dict[str, Any] = {"argv": None, "server": None, "options": {}}

    def launch(argv: list[str]) -> FakeRM:
        made["argv"] = argv
        made["server"] = FakeRM(int(argv[argv.index("--port") + 1]), **made["options"])
        return made["server"]

    monkeypatch.setattr(server_mod, "launch_server", launch)
    return made


@pytest.fixture(scope="module")
def toy_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("toy")
    write_toy_digits(out, train_size=64, val_size=8, seed=0)
    return out


def genrm_config(model: Path, data: Path, rm: Path, run: Path, steps: int) -> Any:
    reward = run.parent / "genrm.py"
    reward.write_text(REWARD)
    return load_config(toy_overrides(
        model, data, run, "algorithm.adv_estimator=grpo", "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        f"trainer.total_training_steps={steps}", "trainer.save_freq=1",
        "reward.reward_model.enable=true", f"reward.reward_model.model_path={rm}",
        "reward.reward_model.rollout.name=vllm", f"reward.custom_reward_function.path={reward}",
        f"trainer.rollout_data_dir={run / 'dump'}"))


def test_the_function_scores_through_the_server(tiny_model_dir: Path, tiny_rm_dir: Path,  # noqa: F811
                                                toy_data: Path, tmp_path: Path, fake_rm: dict[str, Any]) -> None:
    run = tmp_path / "run"
    driver = PPODriver(genrm_config(tiny_model_dir, toy_data, tiny_rm_dir, run, steps=1))
    try:
        assert driver.fit() == 0
    finally:
        driver.reward.close()
    argv = fake_rm["argv"]
    assert argv[1:4] == ["-m", "vllm.entrypoints.openai.api_server", "--model"] and argv[4] == str(tiny_rm_dir)
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.5"  # verl's default share
    rows = [json.loads(line) for line in (run / "dump" / "1.jsonl").read_text().splitlines()]
    assert sorted(fake_rm["server"].chats) == sorted(r["output"] for r in rows)  # every response, once
    assert all(r["score"] == pytest.approx(len(r["output"]) / 10) for r in rows)
    assert fake_rm["server"].poll() is not None  # closed with the engine


@pytest.mark.parametrize("failure", ["dies", "hangs"])
def test_a_failing_server_fails_the_step_naming_it_and_loses_nothing(
        tiny_model_dir: Path, tiny_rm_dir: Path, toy_data: Path, tmp_path: Path,  # noqa: F811
        fake_rm: dict[str, Any], failure: str) -> None:
    """Step 1 is scored, logged and saved; the server then dies (exits after its 8th chat) or
    hangs (the function's request times out): step 2 fails naming the address, and neither its
    metrics nor a checkpoint of it are written."""
    fake_rm["options"] = {"die_after": 8} if failure == "dies" else {}
    run = tmp_path / "run"
    driver = PPODriver(genrm_config(tiny_model_dir, toy_data, tiny_rm_dir, run, steps=2))
    address = driver.reward.server.address  # type: ignore[attr-defined]
    try:
        if failure == "hangs":
            _hang_after_first_step(fake_rm["server"])
        with pytest.raises(RewardServerError) as err:
            driver.fit()
    finally:
        driver.reward.close()
    assert f"`{address}`" in str(err.value)
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1]
    assert sorted(p.name for p in run.glob("global_step_*")) == ["global_step_1"]
    assert not (run / "dump" / "2.jsonl").exists()


def _hang_after_first_step(rm: FakeRM) -> None:
    """From the 9th chat on, the server takes a request and never answers it."""
    handler = rm.http.RequestHandlerClass
    answer = handler.do_POST

    def maybe_hang(self: Any) -> None:
        if len(rm.chats) >= 8:
            rm.release.wait()
            return
        answer(self)
    handler.do_POST = maybe_hang  # type: ignore[method-assign]


def test_a_server_that_exits_at_start_is_named_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    class Exited:
        def poll(self) -> int:
            return 1

        def terminate(self) -> None:
            pass

        def wait(self, timeout: float | None = None) -> int:
            return 1

    monkeypatch.setattr(server_mod, "launch_server", lambda argv: Exited())
    with pytest.raises(RewardServerError, match=r"exited with status 1 .*Fix: make vLLM importable") as err:
        server_mod.RewardServer.start("/models/rm")
    assert "`/models/rm`" in str(err.value) and "`127.0.0.1:" in str(err.value)


def test_verls_serving_settings_reach_the_server() -> None:
    argv = server_mod.server_argv("/m", 8000, {"gpu_memory_utilization": 0.8, "tensor_model_parallel_size": 2,
                                               "prompt_length": 2048, "response_length": 1024, "name": "vllm"})
    assert argv[1:] == ["-m", "vllm.entrypoints.openai.api_server", "--model", "/m", "--host", "127.0.0.1",
                        "--port", "8000", "--gpu-memory-utilization", "0.8", "--tensor-parallel-size", "2",
                        "--max-model-len", "3072"]
