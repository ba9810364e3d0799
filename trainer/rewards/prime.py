"""verl's `prime` reward manager (`verl/workers/reward_manager/prime.py`, `PrimeRewardManager`):
every response scored in a pool of worker processes under one deadline, a failure or a timeout
scored 0.

As verl's `parallel_compute_score_async`:
- the function is called positionally, `fn(data_source, solution_str, ground_truth, extra_info)`,
  with the row's own `extra_info` (nothing added, unlike the `naive` manager);
- up to 64 processes (verl's `num_processes=64`); every call is submitted at once and awaited
  under `asyncio.wait_for(..., timeout=300.0)`, which starts counting when the call is submitted,
  so the 300 s are one deadline for the whole batch, queueing included;
- a call that raised or did not finish by then scores 0.0; a number (a bool too) is its score;
  anything else is read as `float(result[0])` (a tuple or list whose first item is the score);
- the worker processes are terminated (then killed) when the batch is done, so a call stuck in an
  endless loop does not outlive it;
- no reward extras (verl keeps the scores as `acc` in the batch, not as extra info).

One deliberate difference: verl converts the results after the pool is shut down, and a result
that is neither a number nor indexable by 0 (a dict with `score`, as the `naive` manager takes)
raises there, which `verify` catches and answers by scoring **every** row of the batch 0 with a
printed line. Here that result is refused naming the row and the fix, since training on a batch
of zeros teaches nothing and says nothing. Likewise a call that failed because the SandboxFusion
service did not answer (:class:`trainer.rewards.sandbox_fusion.SandboxFusionError`) fails the
step naming the service's URL, where verl scores the row 0.

The processes are forked (verl's `ProcessPoolExecutor()` default on Linux) and find the function
in the parent's memory: a function loaded from `custom_reward_function.path` is not importable by
name in a fresh interpreter, so it is never pickled; each task sends only its row's arguments.
"""

from __future__ import annotations

import multiprocessing
import signal
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, wait
from typing import Any

from trainer.rewards import RewardError
from trainer.rewards.sandbox_fusion import SandboxFusionError

__all__ = ["PRIME_PROCESSES", "PRIME_TIMEOUT_S", "score_prime"]

PRIME_PROCESSES = 64
PRIME_TIMEOUT_S = 300.0

_FN: Callable[..., Any] | None = None  # the reward function, inherited by the forked workers


def _default_signals() -> None:
    """A forked worker inherits the trainer's stop handlers (SIGTERM, SIGUSR1/2 request a
    checkpoint there): here they are reset, so that the terminate at the batch's end ends it."""
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)


def _call(args: tuple[Any, ...]) -> Any:
    assert _FN is not None
    return _FN(*args)


def _result_score(result: Any, row: int, data_source: str) -> float:
    if result is None:
        return 0.0
    if isinstance(result, int | float | bool):
        return float(result)
    if isinstance(result, dict):
        raise RewardError(
            f"`reward_model.reward_manager=prime`: the reward function returned a dict for row {row} "
            f"(`{data_source}`); prime takes a number, or a tuple or list whose first item is the score "
            "(verl's prime manager scores every row of the batch 0 on such a result). Fix: return the "
            "score, or use `reward_model.reward_manager=naive`, which takes a dict with `score`")
    try:
        return float(result[0])
    except (TypeError, IndexError, KeyError, ValueError) as exc:
        raise RewardError(
            f"`reward_model.reward_manager=prime`: the reward function returned {type(result).__name__} for "
            f"row {row} (`{data_source}`), whose first item is not a number ({exc}); return a number, or a "
            "tuple or list whose first item is the score") from None


def score_prime(fn: Callable[..., Any], data_sources: Sequence[str], responses: Sequence[str],
                ground_truths: Sequence[Any], extra_infos: Sequence[Any],
                processes: int = PRIME_PROCESSES, timeout_s: float = PRIME_TIMEOUT_S) -> list[float]:
    """The scores of verl's `prime` manager for one batch (module docstring)."""
    global _FN
    rows = list(zip(data_sources, responses, ground_truths, extra_infos, strict=True))
    if not rows:
        return []
    _FN = fn
    pool = ProcessPoolExecutor(max_workers=max(1, min(processes, len(rows))),
                               mp_context=multiprocessing.get_context("fork"), initializer=_default_signals)
    try:
        futures: list[Future[Any]] = [pool.submit(_call, row) for row in rows]
        wait(futures, timeout=timeout_s)
        for future in futures:  # a dead SandboxFusion service fails the step, in every manager
            if future.done() and not future.cancelled() and isinstance(future.exception(), SandboxFusionError):
                raise future.exception()  # type: ignore[misc]
        results: list[Any] = []
        for future in futures:
            if not future.done() or future.cancelled() or future.exception() is not None:
                results.append(None)  # verl: "[Timeout]" / "[Error]" rows score 0
            else:
                results.append(future.result())
    finally:
        _shutdown(pool)
        _FN = None
    return [_result_score(r, i, rows[i][0]) for i, r in enumerate(results)]


def _shutdown(pool: ProcessPoolExecutor) -> None:
    """verl terminates every worker (then kills one that lingers 5 s) rather than waiting for a
    call that may never end."""
    procs = list(getattr(pool, "_processes", {}).values())
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(5)
        if proc.is_alive():
            proc.kill()  # multiprocessing's own signal: a process gone meanwhile is no error
            proc.join(5)
    pool.shutdown(wait=False, cancel_futures=True)
