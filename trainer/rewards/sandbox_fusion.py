"""Code rewards through a SandboxFusion service, as verl scores them
(`verl/utils/reward_score/sandbox_fusion/`, verl 0.9.1: `compute_score`, `check_correctness`,
`_process_single_case`, `call_sandbox_api`).

With `reward_model.sandbox_fusion.url` set (verl 0.9.1: `reward.sandbox_fusion.url`) and no
`custom_reward_function.path`, the built-in scorer of the code data sources (`codecontests`,
`apps`, `codeforces`, `taco`) runs the response's code on each test case of the row's ground truth
(`{"inputs": [...], "outputs": [...]}`, optional `fn_name` and `assert_case`) through the service's
`run_code` endpoint and scores the share of the first 10 cases passed (verl's `continuous=True`).

- The request is verl's: the code (wrapped to call `fn_name` on JSON-lines arguments when the
  ground truth names one), `stdin` the case's input, `compile_timeout` = `run_timeout` = 10 s,
  `memory_limit_MB` from `sandbox_fusion.memory_limit_mb`, `language` python; the HTTP timeout
  is `2 * 10 + 10` s, a 504 is tried again (3 tries, 1 and 2 s apart), any other failure is not.
- A case passes when the service answers `Success` with a `Finished` run whose stdout equals the
  expected output (trailing newlines dropped). A compile error marks the later cases failed, as
  verl's `check_correctness` does.
- At most `sandbox_fusion.max_concurrent` requests are in flight at once over the whole scoring
  (verl's semaphore); the cases of one response are sent together.
- One difference: where verl scores a case whose request failed (the service refused the
  connection, timed out, or answered an HTTP error) as not passed, here the step fails with an
  error naming the URL and the fix, since every score of that step would be 0 for a reason
  outside the model.
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.synchronize
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from trainer.agent.tools.http_service import post_json_blocking
from trainer.agent.tools.sandbox_fusion import FUSION_RETRY

__all__ = ["SandboxFusionError", "SandboxScorer", "check_correctness", "extract_code"]

TIMEOUT = 10
"""verl's `compute_score` default: each case's compile and run timeout, in seconds."""
API_TIMEOUT = 10
"""verl's `API_TIMEOUT`: seconds added to the two timeouts for the HTTP request."""
CONTINUOUS_CASES = 10
"""verl's `continuous=True`: the score is the pass rate of the first this many cases."""

# verl's `_process_single_case` wrapper for a ground truth naming `fn_name` (python), verbatim.
_FN_WRAPPER = """
import traceback
from string import *
from re import *
from datetime import *
from collections import *
from heapq import *
from bisect import *
from copy import *
from math import *
from random import *
from statistics import *
from itertools import *
from functools import *
from operator import *
from io import *
from sys import *
from json import *
from builtins import *
from typing import *
import string
import re
import datetime
import collections
import heapq
import bisect
import copy
import math
import random
import statistics
import itertools
import functools
import operator
import io
import sys
import json

# === User's Original Code START ===
{generation}
# === User's Original Code END ===

_SANDBOX_FN_NAME = "{fn_name}"

def _execute_user_function():
    # --- Input Parsing ---
    _raw_input_str = sys.stdin.read()
    _args = []
    if _raw_input_str.strip(): # If there's input
        try:
            _args = [json.loads(line) for line in _raw_input_str.split('\\n')]
        except json.JSONDecodeError as _je:
            sys.stderr.write(f"WrapperError: Invalid JSON input for '{{_SANDBOX_FN_NAME}}': {{_je}}\\nInput was: "
                              f"{{_raw_input_str[:200]}}\\n")
            return None, True # result, error_occurred

    # --- Function Location and Execution ---
    try:
        _target_callable = None
        # Try global scope first
        if _SANDBOX_FN_NAME in globals():
            _target_callable = globals()[_SANDBOX_FN_NAME]
        # Else, if 'Solution' class exists, try to get its method
        elif 'Solution' in globals():
            _Solution_class = globals()['Solution']
            # Attempt to instantiate and get method.
            # Errors (e.g., Solution not a class, instantiation fails, method missing)
            # will be caught by the broad except block below.
            _solution_instance = _Solution_class()
            _target_callable = getattr(_solution_instance, _SANDBOX_FN_NAME)

        if not _target_callable:
            sys.stderr.write(f"WrapperError: Function or method '{{_SANDBOX_FN_NAME}}' not found.\\n")
            return None, True # result, error_occurred

        _fn_result = _target_callable(*_args)
        return _fn_result, False # result, no_error
    except Exception: # Catches errors from Solution instantiation, getattr, or function call
        sys.stderr.write(f"Error during setup or execution of '{{_SANDBOX_FN_NAME}}':\\n{{traceback.format_exc()}}\\n")
        return None, True # result, error_occurred

if __name__ == '__main__':
    _result, _error_occurred = _execute_user_function()

    if not _error_occurred:
        # Serialize result to stdout
        if isinstance(_result, (dict, list, tuple)) or _result is None or isinstance(_result, bool):
            print(json.dumps(_result))
        elif isinstance(_result, (int, float, str)):
            print(str(_result)) # Ensure string conversion for print
        else:
            # For other types, default to string representation.
            print(str(_result))
    # Optional: To explicitly exit with an error code if the sandbox relies on it
    # else:
    #    sys.exit(1)
"""


class SandboxFusionError(RuntimeError):
    """A request to the SandboxFusion service failed (dead, timing out, or answering an error)."""


def extract_code(completion: str) -> str | None:
    """The code of a response as verl's `compute_score` takes it: after the last ```` ```python ````
    up to the next fence, else the first fenced block (a language line dropped); None without a
    fence (verl scores such a response 0)."""
    if "```python" in completion:
        return completion.split("```python")[-1].split("```")[0]
    if "```" in completion:
        parts = completion.split("```")
        solution = parts[1]
        if "\n" in solution:
            first_line, rest = solution.split("\n", 1)
            if first_line.strip().isalpha():
                solution = rest
        return solution
    return None


def _case_status(response: dict[str, Any], expected: Any) -> bool | int:
    """verl's `_process_single_case` reading of one `run_code` answer: True passed, False wrong
    answer, -1 sandbox or unknown error, -2 runtime error, -3 timeout, -4 compile error."""
    status = response.get("status")
    compile_result = response.get("compile_result") or {}
    run_result = response.get("run_result") or {}
    if status == "Success":
        if run_result.get("status") != "Finished":
            return -1
        actual = run_result.get("stdout") if run_result.get("stdout") is not None else ""
        return expected is None or str(actual).rstrip("\n") == str(expected).rstrip("\n")
    if status != "Failed":
        return -1  # `SandboxError` or an unknown status
    compile_status = compile_result.get("status")
    if compile_result and (compile_status in ("Error", "TimeLimitExceeded")
                           or (compile_status == "Finished" and compile_result.get("return_code") != 0)):
        return -4
    run_status = run_result.get("status")
    if not run_result:
        return -1
    if run_status == "TimeLimitExceeded":
        return -3
    if run_status == "Error" or (run_status == "Finished" and run_result.get("return_code") != 0):
        return -2
    return -1


Gate = threading.Semaphore | multiprocessing.synchronize.Semaphore
Post = Callable[[str, dict[str, Any], float], tuple[Any | None, str | None]]


def _post_run_code(url: str, payload: dict[str, Any], timeout: float) -> tuple[Any | None, str | None]:
    """The one HTTP call (verl's `call_sandbox_api` retry rule: 3 tries on a 504 only)."""
    return post_json_blocking(url, payload, timeout, FUSION_RETRY)


def check_correctness(url: str, in_outs: dict[str, Any], generation: str, memory_limit_mb: int,
                      gate: Gate, timeout: int = TIMEOUT, post: Post = _post_run_code
                      ) -> list[bool | int]:
    """Each case's result (verl's `check_correctness`, python): the cases run together, at most
    as many requests in flight as `gate` lets through."""
    inputs, outputs = in_outs["inputs"], in_outs["outputs"]
    fn_name = in_outs.get("fn_name")
    asserts = in_outs.get("assert_case", [""] * len(inputs))
    if not inputs:
        return []
    if len(inputs) != len(outputs) or len(asserts) != len(inputs):
        return [-1] * len(inputs)

    def one(i: int) -> bool | int:
        code = generation + "\n\n" + asserts[i]
        if fn_name:
            code = _FN_WRAPPER.format(generation=code, fn_name=fn_name)
        payload = {"compile_timeout": timeout, "run_timeout": timeout, "code": code,
                   "stdin": None if inputs[i] is None else str(inputs[i]), "memory_limit_MB": memory_limit_mb,
                   "language": "python", "files": {}, "fetch_files": []}
        with gate:
            response, error = post(url, payload, float(2 * timeout + API_TIMEOUT))
        if error is not None or not response:
            raise SandboxFusionError(
                f"the SandboxFusion service at `{url}` did not answer a `run_code` request ({error}). Fix: "
                "start the service there (or point `reward_model.sandbox_fusion.url` at one that runs), or "
                "remove `reward_model.sandbox_fusion.url` to score without it")
        return _case_status(response, outputs[i])

    with ThreadPoolExecutor(max_workers=max(32, (os.cpu_count() or 1) * 5)) as pool:  # verl's pool size
        results = list(pool.map(one, range(len(inputs))))
    compile_errors = [i for i, r in enumerate(results) if r == -4]
    if compile_errors:
        results[compile_errors[0] + 1:] = [-4] * (len(results) - compile_errors[0] - 1)
    return results


class SandboxScorer:
    """The code sources' scorer with the service's settings, shared by every call of one run:
    one bound on the requests in flight (verl's one `multiprocessing.Manager` semaphore), a
    process-shared semaphore, so that it holds also over the `prime` manager's forked processes."""

    def __init__(self, url: str, max_concurrent: int, memory_limit_mb: int, post: Post = _post_run_code) -> None:
        self.url, self.memory_limit_mb, self.post = url, memory_limit_mb, post
        self.gate = multiprocessing.get_context("fork").BoundedSemaphore(max_concurrent)

    def __call__(self, completion: str, test_cases: Any) -> float:
        """verl's `compute_score(..., continuous=True)`: the pass rate of the first 10 cases; 0
        without a fenced code block or with test cases that are not `inputs`/`outputs`."""
        solution = extract_code(completion)
        if solution is None:
            return 0.0
        if not isinstance(test_cases, dict):
            try:
                test_cases = json.loads(test_cases)
            except (TypeError, json.JSONDecodeError):
                return 0.0
        if not isinstance(test_cases, dict):
            return 0.0
        if isinstance(test_cases.get("assert_case"), list):
            test_cases.setdefault("inputs", ["" for _ in test_cases["assert_case"]])
            test_cases.setdefault("outputs", [None for _ in test_cases["assert_case"]])
        elif "inputs" not in test_cases or "outputs" not in test_cases:
            return 0.0
        results = check_correctness(self.url, test_cases, solution, self.memory_limit_mb, self.gate, post=self.post)
        first = results[:CONTINUOUS_CASES]
        return sum(1 for r in first if r is True) / len(first) if first else 0.0
