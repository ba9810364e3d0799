"""The `python` tool: its answer (stdout then stderr, as verl's SandboxFusionTool gives, and an
`error:` line when the run was stopped), its metrics (which isolation held), its config and its
example file. The hostile cases of the sandbox itself are in `test_sandbox.py`."""

from __future__ import annotations

import asyncio
import os
import re
import signal
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.trainer.agent.sandbox_support import ROOT, needs, sandbox_python, small_limits
from trainer.agent.tools import AgentConfigError, PythonTool, load_tools
from trainer.agent.tools.python_tool import KEYS, describe
from trainer.agent.tools.sandbox import (
    Isolation,
    SandboxError,
    SandboxLimits,
    SandboxResult,
    check_interpreter,
)

REPO = Path(__file__).resolve().parents[3]


def tool(tmp_path: Path, **config: Any) -> PythonTool:
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    return PythonTool({"type": "native", "python": sandbox_python(), "tmp_dir": str(work),
                       "timeout": 20, "memory_limit_mb": 256, **config})


def call(t: PythonTool, **parameters: Any) -> tuple[str, float | None, dict[str, Any]]:
    resp, reward, metrics = asyncio.run(t.execute("i", parameters))
    return resp.text, reward, metrics


def test_the_answer_is_stdout_then_stderr(tmp_path: Path) -> None:
    text, reward, metrics = call(tool(tmp_path), code="import sys\nprint(6 * 7)\nsys.stderr.write('warn\\n')")
    assert (text, reward) == ("42\nwarn\n", None)
    assert metrics["exit_code"] == 0 and metrics["timed_out"] == 0.0 and metrics["output_truncated"] == 0.0


def test_an_exception_is_its_traceback(tmp_path: Path) -> None:
    text, _, metrics = call(tool(tmp_path), code="x = 1\n1 / 0")
    assert text.startswith("Traceback (most recent call last):\n  File \"main.py\", line 2"), text
    assert text.endswith("ZeroDivisionError: division by zero\n") and metrics["exit_code"] == 1


def test_a_syntax_error_is_told_as_python_tells_it(tmp_path: Path) -> None:
    text, _, metrics = call(tool(tmp_path), code="print('ok')\ndef (:\n")
    assert 'File "main.py", line 2' in text and "SyntaxError" in text, text
    assert "ok" not in text and metrics["exit_code"] == 1


def test_sys_exit_gives_its_code(tmp_path: Path) -> None:
    text, _, metrics = call(tool(tmp_path), code="import sys\nprint('bye')\nsys.exit(3)")
    assert (text, metrics["exit_code"]) == ("bye\n", 3)


def test_a_timeout_is_told(tmp_path: Path) -> None:
    text, _, metrics = call(tool(tmp_path, timeout=1), code="print('started', flush=True)\nwhile True:\n    pass")
    assert text == "started\nerror: timed out after 1 s; the process was stopped"
    assert metrics["timed_out"] == 1.0


def test_a_flood_is_cut_and_told(tmp_path: Path) -> None:
    text, _, metrics = call(tool(tmp_path, max_output_bytes=100), code="while True:\n    print('y' * 10)")
    assert text == "yyyyyyyyyy\n" * 9 + "y" + "\nerror: output passed 100 bytes; the process was stopped"
    assert metrics["output_truncated"] == 1.0


def test_the_metrics_say_which_isolation_held(tmp_path: Path) -> None:
    _, _, metrics = call(tool(tmp_path), code="b = bytearray(30 << 20)\nfor i in range(0, len(b), 4096):\n"
                         "    b[i] = 1\nimport time\ntime.sleep(0.3)")
    assert metrics["uid"] == (small_limits(tmp_path).uid if ROOT else os.getuid()) and metrics["uid"] != 0
    assert (metrics["sandbox_strict"], metrics["network_isolated"], metrics["pid_namespace"],
            metrics["private_tmp"], metrics["memory_exceeded"]) == (1.0, 1.0, 1.0, 1.0, 0.0)
    assert 30 < metrics["memory_peak_mib"] < 200, metrics
    assert "isolation_note" not in metrics


def test_a_site_that_names_rlimits_gets_it_and_the_metrics_say_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPCRL_PYTHON_SANDBOX", "rlimits")
    text, _, metrics = call(tool(tmp_path), code="print('ran')")
    assert text == "ran\n"
    assert (metrics["sandbox_strict"], metrics["network_isolated"], metrics["private_tmp"]) == (0.0, 0.0, 0.0)
    assert "mode `rlimits` (named by the site)" in metrics["isolation_note"]


def test_an_unknown_sandbox_mode_stops_the_tool_at_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPCRL_PYTHON_SANDBOX", "off")
    with pytest.raises(AgentConfigError, match=r"`HPCRL_PYTHON_SANDBOX=off` names no sandbox mode"):
        tool(tmp_path)


def test_a_call_over_its_memory_is_told(tmp_path: Path) -> None:
    code = ("import os, time\nfor _ in range(4):\n    if os.fork() == 0:\n"
            "        b = bytearray(100 << 20)\n        for i in range(0, len(b), 4096):\n            b[i] = 1\n"
            "        time.sleep(20)\n        os._exit(0)\nos.wait()")
    text, _, metrics = call(tool(tmp_path, memory_limit_mb=256, max_processes=8), code=code)
    assert metrics["memory_exceeded"] == 1.0
    assert re.fullmatch(r"error: the call's processes held \d+ MiB, over its memory limit of 256 MiB; "
                        r"all were stopped", text), text


def test_a_missing_argument_is_tool_text(tmp_path: Path) -> None:
    assert call(tool(tmp_path))[0] == "error: missing the `code` argument"


@pytest.mark.parametrize(("returncode", "timed_out", "truncated", "tail"), [
    (0, False, False, None),
    (1, False, False, None),
    (128 + signal.SIGXCPU, False, False, "error: the process was killed by SIGXCPU (CPU time limit of 30 s)"),
    (-signal.SIGKILL, False, False, "error: the process was killed by SIGKILL"),
    (None, False, False, "error: the process could not be collected"),
])
def test_describe(returncode: int | None, timed_out: bool, truncated: bool, tail: str | None) -> None:
    res = SandboxResult(b"out\n", b"", returncode, timed_out, truncated, 0.1, Isolation("strict", True), "/w")
    text = describe(res, SandboxLimits(cpu_time=30))
    assert text == "out\n" + (tail or "")


def test_unknown_config_keys_are_refused_listing_the_valid_ones(tmp_path: Path) -> None:
    with pytest.raises(AgentConfigError, match=r"unknown key\(s\) \['timout'\].*'timeout'"):
        tool(tmp_path, timout=3)


@pytest.mark.parametrize(("key", "value", "want"), [
    ("timeout", "30", "a positive number"), ("timeout", 0, "a positive number"),
    ("cpu_time", 1.5, "a positive integer"), ("max_processes", -1, "a positive integer"),
    ("allow_network", "no", "true or false"), ("memory_limit_mb", True, "a positive integer"),
    ("python", "", "a non-empty string"),
])
def test_config_values_of_the_wrong_kind_are_refused(tmp_path: Path, key: str, value: Any, want: str) -> None:
    with pytest.raises(AgentConfigError, match=rf"`{key}: {value!r}` must be {want}"):
        tool(tmp_path, **{key: value})


def test_config_values_reach_the_limits(tmp_path: Path) -> None:
    t = tool(tmp_path, timeout=2, cpu_time=3, max_processes=4, allow_network=True, max_concurrency=2)
    assert (t.limits.timeout, t.limits.cpu_time, t.limits.max_processes) == (2, 3, 4)
    assert t.limits.allow_network and t.max_concurrency == 2


def test_an_unknown_user_is_refused(tmp_path: Path) -> None:
    needs(ROOT, "`user` applies only when the trainer runs as root")
    with pytest.raises(AgentConfigError, match=r"`user: no-such-user-x` is not a user of this node"):
        tool(tmp_path, user="no-such-user-x")


@pytest.mark.parametrize("user", [None, "root", 0])
def test_a_root_trainer_never_runs_the_code_as_root(tmp_path: Path, user: Any) -> None:
    needs(ROOT, "`user` applies only when the trainer runs as root")
    with pytest.raises(AgentConfigError, match=r"(would run the model's code as root|is root); .*"
                                               r"`user: nobody`"):
        tool(tmp_path, user=user)


def test_a_sandbox_that_cannot_be_set_up_is_told(tmp_path: Path) -> None:
    res = SandboxResult(b"", b"", 125, False, False, 0.1, Isolation("strict", True), "/w",
                        report={"setup_error": "unshare(user, ...): Operation not permitted (errno 1)"})
    assert describe(res, SandboxLimits()) == ("error: the sandbox could not be set up (unshare(user, ...): "
                                              "Operation not permitted (errno 1))")


def test_an_interpreter_that_cannot_run_is_refused_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(SandboxError, match=r"`/nonexistent/python` cannot run.*set the tool's `python:`"):
        check_interpreter("/nonexistent/python", None, None)


def test_the_python_example_config_loads(tmp_path: Path) -> None:
    data = yaml.safe_load((REPO / "trainer/agent/configs/python_tool_config.yaml").read_text())
    config = data["tools"][0]["config"]
    assert set(config) - {"type"} <= set(KEYS), set(config) - set(KEYS)
    config["python"] = sandbox_python()  # the example leaves the trainer's own interpreter
    path = tmp_path / "python_tool_config.yaml"
    path.write_text(yaml.safe_dump(data))
    (t,) = load_tools(path)
    assert isinstance(t, PythonTool) and t.name == "python"
    assert t.limits.timeout == 30 and t.limits.max_output_bytes == 65536 and not t.limits.allow_network
    assert call(t, code="print(sum(range(10)))")[0] == "45\n"
