"""verl's `prime` reward manager (`trainer/rewards/prime.py`): positional calls in a pool of
processes, failures and timeouts scored 0, and the same scores as verl 0.9.1's own
`run_reward_scoring` on the same rows."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import wait_until
from tests.verl_env import verl_python
from trainer.rewards import RewardError, load_reward_fn
from trainer.rewards.prime import score_prime

SCORERS = Path(__file__).with_name("prime_scorers.py")
SIDE = Path(__file__).with_name("verl_prime_side.py")


def _fn(name: str):  # type: ignore[no-untyped-def]
    return load_reward_fn(str(SCORERS), name)  # as `custom_reward_function.path` loads it


def _cases() -> list[dict]:
    responses = ["4", "5", "boom", "yes", "no", "pair", " 4 ", "7"]
    return [
        {"scorer": "exact", "responses": responses, "truths": ["4"] * len(responses),
         "sources": ["a", "b"] * (len(responses) // 2),
         "infos": [{"bonus": i % 3 == 0} for i in range(len(responses))]},
        {"scorer": "exact", "responses": ["1"], "truths": [1], "sources": ["a"], "infos": [None]},
    ]


def test_a_failing_row_scores_zero_and_the_others_their_own() -> None:
    case = _cases()[0]
    scores = score_prime(_fn("exact"), case["sources"], case["responses"], case["truths"], case["infos"], processes=3)
    assert scores == [1.5, 0.125, 0.0, 1.0, 0.0, 0.25, 1.5, 0.125]


def test_a_row_past_the_deadline_scores_zero_and_its_process_is_ended(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool's own processes (seen as the batch ends: another test's, or another thread's,
    are not this one's) are all gone when the call returns."""
    from trainer.rewards import prime

    seen: list[Any] = []
    shutdown = prime._shutdown

    def watched(pool: Any) -> None:
        seen.extend(pool._processes.values())
        shutdown(pool)

    monkeypatch.setattr(prime, "_shutdown", watched)
    began = time.monotonic()
    scores = score_prime(_fn("slow"), ["a"] * 3, ["x", "hang", "y"], [None] * 3, [None] * 3,
                         processes=2, timeout_s=2.0)
    assert scores == [1.0, 0.0, 1.0]
    assert time.monotonic() - began < 60  # the hanging call (an hour) did not hold the batch
    assert len(seen) == 2
    # ended, the hanging one too: killed before the call returned, reaped at once unless the
    # machine is busy (a `make test-fresh` at 20b113f's successor saw one still alive right then)
    wait_until(lambda: not [p for p in seen if p.is_alive()], "the pool's processes ended", timeout_s=30)


def test_workers_end_at_once_under_the_trainer_s_stop_handlers() -> None:
    """The trainer catches SIGTERM (a stop request); the forked workers must not inherit that, or
    the batch's end would wait out each worker's grace before killing it."""
    import signal

    from trainer.stop import StopRequest

    stop = StopRequest()
    stop.install()
    try:
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None)
        assert score_prime(_fn("term_default"), ["a"] * 4, ["x"] * 4, [None] * 4, [None] * 4,
                           processes=4) == [1.0] * 4
    finally:
        stop.uninstall()


def test_a_dict_result_is_refused_naming_the_fix() -> None:
    with pytest.raises(RewardError, match=r"returned a dict for row 0 .*reward_manager=naive"):
        score_prime(_fn("as_dict"), ["a"], ["x"], [None], [None])


def test_the_config_accepts_prime_and_no_manager_keywords() -> None:
    from trainer.config import ConfigError, load_config

    assert load_config(["reward_model.reward_manager=prime"]).reward_model.reward_manager == "prime"
    with pytest.raises(ConfigError, match="`prime` reward manager does not take"):
        load_config(["reward_model.reward_manager=prime", "+reward_model.reward_kwargs.x=1"])


def test_scores_equal_verl_s_run_reward_scoring(tmp_path: Path) -> None:
    python = verl_python()
    cases = _cases()
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    done = subprocess.run([python, str(SIDE), str(tmp_path / "cases.json"), str(tmp_path / "verl.json")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = json.loads((tmp_path / "verl.json").read_text())
    ours = [score_prime(_fn(c["scorer"]), c["sources"], c["responses"], c["truths"], c["infos"], processes=4)
            for c in cases]
    assert ours == theirs
