"""A generative reward model's server: `reward_model.model.path` served by vLLM's
OpenAI-compatible server (`vllm serve`), whose address (`host:port`) the reward function receives
as `reward_router_address`, as verl 0.9.1 passes the address of its reward-model router
(`verl/experimental/reward_loop/reward_manager/naive.py`, `run_single`: `reward_router_address`
and `reward_model_tokenizer` are added to the call when there is a reward model server).

verl starts vLLM replicas behind a router on Ray; here one server process runs next to the
trainer, started by :func:`launch_server` (the one seam a test replaces) and waited for by its
`/health` endpoint, never for a fixed time. A server that died or does not answer is an error
naming its address, raised before or while a step is scored, so the step ends without its
metrics or checkpoint being written."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any, Protocol

__all__ = ["RewardServer", "RewardServerError", "launch_server", "server_argv"]


class RewardServerError(RuntimeError):
    """The reward model server is dead, does not answer, or a scoring through it failed."""


class Process(Protocol):
    def poll(self) -> int | None: ...

    def terminate(self) -> None: ...

    def wait(self, timeout: float | None = None) -> int: ...


#: verl's default share of the device for the reward model's server (`reward.reward_model.rollout`).
GPU_MEMORY_UTILIZATION = 0.5


def server_argv(model_path: str, port: int, serving: Mapping[str, Any] | None = None,
                python: str = sys.executable) -> list[str]:
    """vLLM's OpenAI-compatible server of `model_path` on `port` (the served model's name is its
    path, vLLM's default, as verl's replicas serve it), with verl's serving settings of the
    reward model (`reward_model.rollout.*`): its device share (`gpu_memory_utilization`, verl's
    0.5 when unset; on vLLM's CPU backend the share of host memory), `tensor_model_parallel_size`
    and the context, `prompt_length + response_length` (verl's reward model server length)."""
    serving = serving or {}
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path,
            "--host", "127.0.0.1", "--port", str(port), "--gpu-memory-utilization",
            str(serving.get("gpu_memory_utilization") or GPU_MEMORY_UTILIZATION)]
    if serving.get("tensor_model_parallel_size"):
        argv += ["--tensor-parallel-size", str(serving["tensor_model_parallel_size"])]
    if serving.get("prompt_length") and serving.get("response_length"):
        argv += ["--max-model-len", str(int(serving["prompt_length"]) + int(serving["response_length"]))]
    return argv


def launch_server(argv: list[str]) -> Process:
    """Start the server process (the seam the tests replace with a local HTTP server)."""
    return subprocess.Popen(argv)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RewardServer:
    """One reward model server: its address (`host:port`) and process."""

    def __init__(self, address: str, process: Process) -> None:
        self.address, self.process = address, process

    @classmethod
    def start(cls, model_path: str, serving: Mapping[str, Any] | None = None,
              ready_timeout_s: float = 600.0) -> RewardServer:
        port = _free_port()
        server = cls(f"127.0.0.1:{port}", launch_server(server_argv(model_path, port, serving)))
        deadline = time.monotonic() + ready_timeout_s
        while True:  # wait for the condition (the server answers), with a generous bound
            try:
                server.check(timeout_s=5.0)
                return server
            except RewardServerError as e:
                code = server.process.poll()
                if code is not None:
                    raise RewardServerError(
                        f"the reward model server of `{model_path}` at `{server.address}` exited with "
                        f"status {code} before it answered (its output is above). Fix: make vLLM importable "
                        f"by {sys.executable} (`pip install vllm`), or check `reward_model.model.path`") from e
                if time.monotonic() > deadline:
                    server.close()
                    raise RewardServerError(
                        f"the reward model server of `{model_path}` at `{server.address}` did not answer "
                        f"`/health` within {ready_timeout_s:g}s; it was stopped") from e
            time.sleep(0.5)

    def check(self, timeout_s: float = 30.0) -> None:
        """Raise :class:`RewardServerError` naming the address unless the process runs and
        `/health` answers 200 within `timeout_s`."""
        code = self.process.poll()
        if code is not None:
            raise RewardServerError(f"the reward model server at `{self.address}` exited with status {code}")
        try:
            with urllib.request.urlopen(f"http://{self.address}/health", timeout=timeout_s) as resp:
                status = resp.status
        except (urllib.error.URLError, OSError) as e:
            raise RewardServerError(
                f"the reward model server at `{self.address}` does not answer `/health` within "
                f"{timeout_s:g}s: {e}") from e
        if status != 200:
            raise RewardServerError(f"the reward model server at `{self.address}` answered `/health` with {status}")

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except Exception:  # noqa: BLE001 - a server that does not stop is left to the job's end
                pass


def router_kwargs(server: RewardServer, rm_tokenizer: Any) -> dict[str, Any]:
    """What verl adds to each reward-function call when a reward model server runs."""
    return {"reward_router_address": server.address, "reward_model_tokenizer": rm_tokenizer}
