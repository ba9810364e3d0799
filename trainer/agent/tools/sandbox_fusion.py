"""verl's `SandboxFusionTool` (`verl/tools/sandbox_fusion_tools.py`, its service call in
`verl/utils/reward_score/sandbox_fusion/utils.py`, verl `b178a3cd`), the tool of verl's ReTool
and DAPO multi-turn recipes: the model sends `code` (and may send `timeout`, `language`); the
answer is the run's stdout + stderr when the run finished, else `no stdout here`.

Two backends, by `sandbox_fusion_url`:
- a URL: the SandboxFusion service there, called as verl calls it (the same JSON body, 3 tries
  on a 504, the request timeout `2 * timeout + 10` s);
- `local`: the code runs on the trainer's node in the python tool's sandbox
  (:mod:`trainer.agent.tools.sandbox`, mode `strict` unless the site names another), Python
  only; the model's `timeout` is capped at `default_timeout`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any
from uuid import uuid4

from trainer.agent.base import CallGate, Tool, ToolResponse
from trainer.agent.tools.http_service import RetryRule, post_json
from trainer.agent.tools.loading import AgentConfigError, check_config_keys
from trainer.agent.tools.python_tool import sandbox_limits
from trainer.agent.tools.sandbox import SandboxError, SandboxResult, probe, run_python

__all__ = ["FUSION_RETRY", "NOT_FINISHED", "SUPPORTED_LANGUAGES", "SandboxFusionTool", "fusion_payload"]

KEYS = {"sandbox_fusion_url": "", "num_workers": 10, "enable_global_rate_limit": True, "rate_limit": 10,
        "default_timeout": 30, "default_language": "python", "memory_limit_mb": 1024, "python": None}
"""verl's config keys and defaults (`SandboxFusionTool.__init__`), and this project's `python`:
the interpreter that runs the code with `local` (default: the trainer's)."""
NOT_FINISHED = "no stdout here"
"""The answer when the run did not finish (`execute_code`)."""
FUSION_RETRY = RetryRule(attempts=3, statuses=(504,), on_connection_error=False)
"""`call_sandbox_api`: 3 tries on a gateway timeout (504) only, 1, 2 s apart."""
SUPPORTED_LANGUAGES = (
    "python", "cpp", "nodejs", "go", "go_test", "java", "php", "csharp", "bash", "typescript", "sql",
    "rust", "cuda", "lua", "R", "perl", "D_ut", "ruby", "scala", "julia", "pytest", "junit",
    "kotlin_script", "jest", "verilog", "python_gpu", "lean", "swift", "racket")
"""verl's `SUPPORTED_LANGUAGES`: another language is refused before any call."""


def fusion_payload(code: str, timeout: Any, memory_limit_mb: int, language: str) -> dict[str, Any]:
    """The body verl posts to `run_code` (`call_sandbox_api`, `stdin` None for the tool)."""
    return {"compile_timeout": timeout, "run_timeout": timeout, "code": code, "stdin": None,
            "memory_limit_MB": memory_limit_mb, "language": language, "files": {}, "fetch_files": []}


class SandboxFusionTool(Tool):
    """Port of verl's `verl.tools.sandbox_fusion_tools.SandboxFusionTool` (module docstring)."""

    def __init__(self, config: dict[str, Any], tool_schema: dict[str, Any]) -> None:
        check_config_keys("`SandboxFusionTool`", config, KEYS)
        super().__init__(config, tool_schema)
        values = {**KEYS, **{k: v for k, v in config.items() if k in KEYS and v is not None}}
        self.url = str(values["sandbox_fusion_url"])
        self.default_timeout = values["default_timeout"]
        self.default_language = str(values["default_language"])
        self.memory_limit_mb = int(values["memory_limit_mb"])
        slots = int(values["num_workers"])
        if values["enable_global_rate_limit"]:
            slots = min(slots, int(values["rate_limit"]))
        self.slots = max(1, slots)
        self._gate = CallGate(self.slots)
        self._instances: dict[str, dict[str, Any]] = {}
        if self.url == "local":
            self.limits = sandbox_limits({"memory_limit_mb": self.memory_limit_mb,
                                          "timeout": float(self.default_timeout),
                                          "cpu_time": math.ceil(float(self.default_timeout)),
                                          "python": values["python"]})
            try:
                probe(self.limits)
            except SandboxError as e:
                raise AgentConfigError(str(e)) from e
        elif values["python"] is not None:
            raise AgentConfigError("`SandboxFusionTool` config: `python` is for `sandbox_fusion_url: "
                                   "local`; the service runs the code in its own environment")
        elif not self.url.startswith(("http://", "https://")):
            raise AgentConfigError(
                f"`SandboxFusionTool` config: `sandbox_fusion_url: {self.url!r}` must be the "
                "SandboxFusion service's `run_code` URL, or `local` to run the code in hpcrl's "
                "sandbox on the trainer's node (docs/agent-loops.md, 'The python tool's sandbox')")

    async def create(self, instance_id: str | None = None, ground_truth: str | None = None,
                     **kwargs: Any) -> tuple[str, ToolResponse]:
        instance_id = instance_id or str(uuid4())
        self._instances[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": []}
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
                      ) -> tuple[ToolResponse, None, dict[str, Any]]:
        code = parameters.get("code", "")
        code = code if isinstance(code, str) else str(code)
        timeout = parameters.get("timeout", self.default_timeout)
        language = parameters.get("language", self.default_language)
        async with self._gate():
            if self.url == "local":
                text, metrics = await self._run_local(code, timeout, language)
            else:
                text, metrics = await self._run_service(code, timeout, language)
        return ToolResponse(text=text), None, metrics  # verl: no step reward

    async def _run_service(self, code: str, timeout: Any, language: str) -> tuple[str, dict[str, Any]]:
        if language not in SUPPORTED_LANGUAGES:
            return NOT_FINISHED, {"status": "unsupported_language"}
        try:
            wait = float(timeout) * 2 + 10  # verl: compile + run + API_TIMEOUT
        except (TypeError, ValueError):
            wait = float(self.default_timeout) * 2 + 10
        response, error = await post_json(
            self.url, fusion_payload(code, timeout, self.memory_limit_mb, language), wait, FUSION_RETRY)
        run = (response or {}).get("run_result") or {}
        if error or run.get("status") != "Finished":
            return NOT_FINISHED, {"status": "api_error" if error else str(run.get("status")),
                                  "api_request_error": error}
        return (run.get("stdout") or "") + (run.get("stderr") or ""), {
            "status": "finished", "exit_code": run.get("return_code")}

    async def _run_local(self, code: str, timeout: Any, language: str) -> tuple[str, dict[str, Any]]:
        if language != "python":
            return (f"error: language `{language}` is not run here: `sandbox_fusion_url: local` runs "
                    "python only", {"status": "unsupported_language"})
        try:
            seconds = min(float(timeout), float(self.default_timeout))
        except (TypeError, ValueError):
            seconds = float(self.default_timeout)
        seconds = max(seconds, 0.1)
        limits = dataclasses.replace(self.limits, timeout=seconds, cpu_time=max(1, math.ceil(seconds)))
        res = await run_python(code, limits)
        return (res.stdout + res.stderr).decode("utf-8", errors="replace") if _finished(res) else NOT_FINISHED, {
            "status": "finished" if _finished(res) else "not_finished", "exit_code": res.returncode,
            "timed_out": float(res.timed_out), "memory_exceeded": float(res.memory_exceeded),
            "sandbox_strict": float(res.isolation.mode == "strict")}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> Any:
        return self._instances[instance_id]["reward"]

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self._instances.pop(instance_id, None)


def _finished(res: SandboxResult) -> bool:
    """SandboxFusion's `Finished`: the program ended by itself (any exit code, a traceback
    included), not by the time limit, a limit of the sandbox, or a signal."""
    return (not res.timed_out and not res.memory_exceeded and res.setup_error is None
            and res.returncode is not None and res.signal is None)
