"""`python`: runs the model's code in a bounded child process (:mod:`trainer.agent.tools.sandbox`)
and answers with what it printed, stdout then stderr, as verl's `SandboxFusionTool` does
(`verl/tools/sandbox_fusion_tools.py`, `execute_code`: `stdout + stderr`), here with no service:
the code runs on the trainer's node."""

from __future__ import annotations

import os
import pwd
import signal
from dataclasses import fields
from typing import Any, ClassVar

from trainer.agent.base import CallGate, Tool, ToolResponse
from trainer.agent.tools.loading import AgentConfigError, check_config_keys, function_schema
from trainer.agent.tools.sandbox import (
    SandboxError,
    SandboxLimits,
    SandboxResult,
    probe,
    run_python,
    sandbox_mode,
)

__all__ = ["PythonTool", "describe", "sandbox_limits"]

_LIMIT_KEYS = {f.name: f.default for f in fields(SandboxLimits) if f.name not in ("uid", "gid", "mode")}
KEYS: dict[str, Any] = {**_LIMIT_KEYS, "user": "nobody", "max_concurrency": 8}
"""The config keys and their defaults: :class:`~trainer.agent.tools.sandbox.SandboxLimits`'
fields (`timeout` seconds of wall clock, `cpu_time` seconds, `memory_limit_mb`, ...), `user`
(whom the code runs as when the trainer is root: the sandbox is built as that user) and
`max_concurrency` (runs at once in one process). The sandbox's mode is the site's to weaken
(`HPCRL_PYTHON_SANDBOX`, :func:`~trainer.agent.tools.sandbox.sandbox_mode`), never a tool file's."""


def _checked(key: str, value: Any) -> Any:
    """`value` of config key `key`, of its default's type (a positive number for a number)."""
    default = _LIMIT_KEYS[key]
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, int | float):
        ok = isinstance(value, int | float) and not isinstance(value, bool) and value > 0 \
            and (isinstance(default, float) or float(value).is_integer())
    else:
        ok = isinstance(value, str) and bool(value)
    if not ok:
        want = {bool: "true or false", int: "a positive integer", float: "a positive number"}.get(
            type(default), "a non-empty string")
        raise AgentConfigError(f"`PythonTool` config: `{key}: {value!r}` must be {want}")
    return int(value) if type(default) is int else value


def sandbox_limits(config: dict[str, Any]) -> SandboxLimits:
    """The sandbox limits of a python-tool config (the keys of :data:`KEYS`), its mode the
    site's, its user resolved when the trainer is root."""
    values = {k: _checked(k, config[k]) for k in _LIMIT_KEYS if config.get(k) is not None}
    try:
        values["mode"] = sandbox_mode()
    except SandboxError as e:
        raise AgentConfigError(str(e)) from e
    user = config.get("user", KEYS["user"])
    if os.geteuid() == 0:
        if user is None:
            raise AgentConfigError(
                "`PythonTool` config: `user: null` would run the model's code as root; the "
                "trainer runs as root here, so name the unprivileged user the sandbox is built as "
                "(`user: nobody`, the default)")
        try:
            entry = pwd.getpwuid(user) if isinstance(user, int) else pwd.getpwnam(str(user))
        except KeyError as e:
            raise AgentConfigError(f"`PythonTool` config: `user: {user}` is not a user of this "
                                   f"node; name one (`nobody`, the default)") from e
        if entry.pw_uid == 0:
            raise AgentConfigError(f"`PythonTool` config: `user: {user}` is root; name the "
                                   "unprivileged user the sandbox is built as (`user: nobody`, "
                                   "the default)")
        values.update(uid=entry.pw_uid, gid=entry.pw_gid)
    return SandboxLimits(**values)


def describe(res: SandboxResult, limits: SandboxLimits) -> str:
    """The tool's answer: stdout + stderr, then one `error: ...` line when the run did not end
    by itself."""
    text = (res.stdout + res.stderr).decode("utf-8", errors="replace")
    if res.timed_out:
        why = f"timed out after {limits.timeout:g} s; the process was stopped"
    elif res.output_truncated:
        why = f"output passed {limits.max_output_bytes} bytes; the process was stopped"
    elif res.setup_error is not None:
        why = f"the sandbox could not be set up ({res.setup_error})"
    elif res.memory_exceeded:
        held = int(res.report.get("held_bytes", 0)) >> 20  # type: ignore[call-overload]
        why = (f"the call's processes held {held} MiB, over its memory limit of "
               f"{limits.memory_limit_mb} MiB; all were stopped")
    elif res.returncode is None:
        why = "the process could not be collected"
    elif res.signal is not None:
        try:
            name = signal.Signals(res.signal).name
        except ValueError:
            name = f"signal {res.signal}"
        why = f"the process was killed by {name}" + (
            f" (CPU time limit of {limits.cpu_time} s)" if res.signal == signal.SIGXCPU else "")
    else:
        return text
    return f"{text}{'' if not text or text.endswith(chr(10)) else chr(10)}error: {why}"


class PythonTool(Tool):
    """The `python` tool: `{"code": "..."}` -> what the code printed (stdout, then stderr).
    Config keys: :data:`KEYS`. Metrics of each call say which isolation held."""

    default_schema: ClassVar[dict[str, Any]] = function_schema(
        "python", "Run a Python program and return what it prints (stdout, then stderr). "
        "Nothing persists between calls; there is no network.",
        {"code": "The Python source to run; print the values you need."})

    def __init__(self, config: dict[str, Any], tool_schema: dict[str, Any] | None = None) -> None:
        check_config_keys("`PythonTool`", config, KEYS)
        super().__init__(config, tool_schema or self.default_schema)
        self.limits = sandbox_limits(config)
        try:  # built once here, at load, not inside the event loop: refused if it cannot hold
            probe(self.limits)
        except SandboxError as e:
            raise AgentConfigError(str(e)) from e
        self.max_concurrency = int(config.get("max_concurrency") or KEYS["max_concurrency"])
        self._gate = CallGate(self.max_concurrency)

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
                      ) -> tuple[ToolResponse, float | None, dict[str, Any]]:
        code = parameters.get("code")
        if code is None:
            return ToolResponse(text="error: missing the `code` argument"), None, {}
        async with self._gate():
            res = await run_python(str(code), self.limits)
        iso = res.isolation
        metrics: dict[str, Any] = {
            "exit_code": res.returncode, "timed_out": float(res.timed_out),
            "output_truncated": float(res.output_truncated), "wall_s": res.wall_s,
            "network_isolated": float(iso.network), "pid_namespace": float(iso.pid_namespace),
            "private_tmp": float(iso.private_tmp), "sandbox_strict": float(iso.mode == "strict"),
            "memory_exceeded": float(res.memory_exceeded),
            "memory_peak_mib": int(res.report.get("peak_bytes", 0)) / 2**20,  # type: ignore[call-overload]
            "uid": self.limits.uid if self.limits.uid is not None else os.getuid()}
        if iso.note:
            metrics["isolation_note"] = iso.note
        return ToolResponse(text=describe(res, self.limits)), None, metrics
