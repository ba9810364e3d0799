"""Rule-based rewards, chosen per row by `data_source`, or a user function from a file.

A reward function has verl's signature
`compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)` and is called
by keyword, as verl calls it, with `custom_reward_function.reward_kwargs` added to every call. It
returns a number or a dict with a `score` number; the dict's other entries (numbers, or strings
such as `pred`, the vote of the validation's `maj@N`) are reported beside it.
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

from trainer.rewards import arith, gsm8k, math_dapo, math_reward, toy

RewardFn = Callable[..., Any]
ROW_THREADS = "row_threads"
"""An attribute of a reward function: how many rows :func:`score_responses` scores at once."""


class RewardError(ValueError):
    """A reward function cannot be found or returned something unusable."""


GSM8K_SOURCES = ("openai/gsm8k",)
MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
DAPO_MATH_SOURCES = ("math_dapo", "math", "math_dapo_reasoning", "aime*")
CODE_SOURCES = ("codecontests", "apps", "codeforces", "taco")
KNOWN_DATA_SOURCES = (*GSM8K_SOURCES, *MATH_SOURCES, *DAPO_MATH_SOURCES, *CODE_SOURCES, toy.TOY_DIGITS, arith.ARITH)


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict[str, Any] | None = None,
    sandbox: Callable[[str, Any], float] | None = None, **_: Any,
) -> float | dict[str, Any]:
    """The built-in scorer for `data_source`, routed as verl's `default_compute_score` routes
    the sources it shares with this trainer (`KNOWN_DATA_SOURCES`; `aime*`: any name starting
    with `aime`). The code sources (`CODE_SOURCES`) are scored by `sandbox`
    (:class:`trainer.rewards.sandbox_fusion.SandboxScorer`, from `reward_model.sandbox_fusion.url`)."""
    if data_source in CODE_SOURCES:
        if sandbox is None:
            raise RewardError(
                f"`data_source`={data_source!r} is code, scored here through a SandboxFusion service only "
                "(verl's fallback without one, `prime_code`, is not built). Fix: set "
                "`reward_model.sandbox_fusion.url=http://HOST:PORT/run_code`, or give your own scorer with "
                "`custom_reward_function.path=<file.py>`")
        return sandbox(solution_str, ground_truth)
    if data_source in GSM8K_SOURCES:
        return gsm8k.compute_score(solution_str, str(ground_truth))
    if data_source in MATH_SOURCES:
        return math_reward.compute_score(solution_str, ground_truth)
    if data_source in DAPO_MATH_SOURCES or data_source.startswith("aime"):
        return math_dapo.compute_score(solution_str, ground_truth)
    if data_source == toy.TOY_DIGITS:
        return toy.toy_digits_score(solution_str)
    if data_source == arith.ARITH:
        return arith.arith_score(solution_str, str(ground_truth))
    raise RewardError(
        f"no built-in reward for `data_source`={data_source!r}; built-in: "
        f"{', '.join(KNOWN_DATA_SOURCES)}. Give your own with "
        "`custom_reward_function.path=<file.py>` and `custom_reward_function.name=<function>`"
    )


def _with_kwargs(fn: RewardFn, extra: Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
    """Call `fn` with `extra` merged into the keywords, `extra` winning (verl's wrapper)."""
    return fn(*args, **{**kwargs, **extra})


#: The keywords verl's `naive` and `dapo` managers call a reward function with, and `batch`'s.
PER_RESPONSE_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")
BATCH_ARGS = ("data_sources", "solution_strs", "ground_truths", "extra_infos")


def _check_keywords(fn: RewardFn, file: Path, name: str, keywords: Sequence[str]) -> None:
    """Refuse, before any rollout, a function that cannot take verl's keywords."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read (a builtin): the call will tell
        return
    try:
        signature.bind(**dict.fromkeys(keywords))
    except TypeError as err:
        raise RewardError(
            f"`{file}`: `{name}{signature}` cannot be called as verl calls a reward function, by "
            f"keyword with {', '.join(f'`{k}=`' for k in keywords)} ({err}). Fix: give it those "
            "parameter names (or `**kwargs`)") from None


def load_reward_fn(path: str | None, name: str, reward_kwargs: Mapping[str, Any] | None = None,
                   keywords: Sequence[str] = PER_RESPONSE_ARGS) -> RewardFn:
    """`default_compute_score` when `path` is None, else function `name` from the file `path`,
    given `reward_kwargs` (`custom_reward_function.reward_kwargs`) on every call. `keywords`:
    what the reward manager passes (`PER_RESPONSE_ARGS`, or `BATCH_ARGS` and
    `reward_model.reward_kwargs` for `batch`); a function that cannot take them is refused."""
    if path is None:
        return default_compute_score
    file = Path(path).expanduser()
    if not file.is_file():
        raise RewardError(
            f"`custom_reward_function.path`={path} does not exist; give the path of a Python "
            "file defining the reward function, or drop the override to use the built-in scorers"
        )
    spec = importlib.util.spec_from_file_location(f"custom_reward_{file.stem}", file)
    if spec is None or spec.loader is None:
        raise RewardError(f"`custom_reward_function.path`={path} cannot be imported as Python")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        found = [n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_")]
        raise RewardError(
            f"`{file}` has no function `{name}` (`custom_reward_function.name`); functions "
            f"defined there: {', '.join(found) or 'none'}"
        )
    _check_keywords(fn, file, name, [*keywords, *(reward_kwargs or {})])
    return partial(_with_kwargs, fn, dict(reward_kwargs)) if reward_kwargs else fn


def _as_score(result: Any, data_source: str) -> tuple[float, dict[str, Any]]:
    if isinstance(result, dict):
        if "score" not in result:
            raise RewardError(
                f"reward function returned a dict without `score` for `{data_source}`: "
                f"{sorted(result)}; return a float or a dict with a `score` entry"
            )
        extras = {k: (v if isinstance(v, str) else float(v)) for k, v in result.items()
                  if k != "score" and isinstance(v, int | float | str)}
        return float(result["score"]), extras
    if isinstance(result, int | float):  # a bool too: verl's `float(res)`
        return float(result), {}
    raise RewardError(
        f"reward function returned {type(result).__name__} for `{data_source}`; return a float "
        "or a dict with a `score` entry"
    )


def score_batch(
    fn: RewardFn,
    data_sources: Sequence[str],
    responses: Sequence[str],
    ground_truths: Sequence[Any],
    extra_infos: Sequence[dict[str, Any] | None],
    reward_kwargs: Mapping[str, Any] | None = None,
) -> tuple[list[float], dict[str, list[Any]]]:
    """verl's `batch` reward manager: one call with lists (`data_sources`, `solution_strs`,
    `ground_truths`, `extra_infos`) and `reward_model.reward_kwargs` as further keywords,
    returning one float or dict per response."""
    infos = [{**(info or {}), "rollout_reward_scores": {}} for info in extra_infos]
    results = fn(data_sources=list(data_sources), solution_strs=list(responses),
                 ground_truths=list(ground_truths), extra_infos=infos, **dict(reward_kwargs or {}))
    if not isinstance(results, Sequence) or isinstance(results, str) or len(results) != len(responses):
        got = f"{len(results)} results" if isinstance(results, Sequence) else type(results).__name__
        raise RewardError(
            f"`reward_model.reward_manager=batch`: the reward function returned {got} for "
            f"{len(responses)} responses; return a list with one float (or dict with `score`) each")
    return _collect(data_sources, results)


def _collect(data_sources: Sequence[str], results: Sequence[Any]) -> tuple[list[float], dict[str, list[Any]]]:
    """The scores of the reward function's `results` (one per response) and their extra values."""
    scores: list[float] = []
    extras: dict[str, list[Any]] = {}
    for source, result in zip(data_sources, results, strict=True):
        score, more = _as_score(result, source)
        scores.append(score)
        for key, value in more.items():
            extras.setdefault(key, []).append(value)
    return scores, extras


def overlong_penalty(lengths: Sequence[int], max_response_length: int, buffer_len: int,
                     penalty_factor: float) -> list[float]:
    """DAPO's soft overlong punishment: 0 up to `max_response_length - buffer_len` tokens, then
    falling linearly to `-penalty_factor` at the limit (verl's `dapo` reward manager)."""
    expected = max_response_length - buffer_len
    return [min(-(n - expected) / buffer_len * penalty_factor, 0.0) for n in lengths]


def score_responses(
    fn: RewardFn,
    data_sources: Sequence[str],
    responses: Sequence[str],
    ground_truths: Sequence[Any],
    extra_infos: Sequence[dict[str, Any] | None],
    loop_fields: Sequence[Mapping[str, Any]] | None = None,
    num_turns: Sequence[Any] | None = None,
) -> tuple[list[float], dict[str, list[Any]]]:
    """Score each decoded response, calling `fn` by keyword as verl's `naive` and `dapo`
    managers do; return the scores and any extra per-sample values. `extra_info` is built as
    verl 0.9.1's reward loop builds it (`reward_loop/reward_manager/naive.py`, `run_single`): the
    row's `extra_info`, updated with its agent loop's `extra_fields` (`loop_fields`: `raw_prompt`,
    `turn_scores`, `tool_rewards`, ...), then `num_turns` (the row's `__num_turns__`, None when
    not given) and `rollout_reward_scores` ({}) set over whatever the row held.

    A function with `ROW_THREADS` set (the built-in scorers over a SandboxFusion service, whose
    rows wait on it) scores that many rows at once, as verl's reward loop runs its rows in an
    executor; any other is called one row after another."""
    rows = len(responses)
    fields = loop_fields if loop_fields is not None else [{}] * rows
    turns = num_turns if num_turns is not None else [None] * rows

    def one(row: tuple[Any, ...]) -> Any:
        source, text, truth, info, more, n = row
        return fn(data_source=source, solution_str=text, ground_truth=truth,
                  extra_info={**(info or {}), **more, "num_turns": n, "rollout_reward_scores": {}})

    table = list(zip(data_sources, responses, ground_truths, extra_infos, fields, turns, strict=True))
    threads = int(getattr(fn, ROW_THREADS, 0))
    if threads > 1 and rows > 1:
        with ThreadPoolExecutor(max_workers=min(threads, rows)) as pool:
            results = list(pool.map(one, table))
    else:
        results = [one(row) for row in table]
    return _collect(data_sources, results)
