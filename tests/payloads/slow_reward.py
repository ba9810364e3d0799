"""Reward for the requeue lab tests: the toy task's own score, after a pause of
`SLOW_REWARD_S_PER_ROW` seconds per row in the runs listed in `SLOW_REWARD_RUNS` (restart
numbers, default `0`: the first run only). Slow steps let a short Slurm time limit, a preemption
or a kill fall in the middle of a run, fast later runs keep the tests short. The pause changes
no number: the weights are those of a run without it."""

import os
import time

from trainer.rewards.toy import toy_digits_score


def compute_score(data_source, solution_str, ground_truth, extra_info=None):  # noqa: ANN001, ANN201
    runs = os.environ.get("SLOW_REWARD_RUNS", "0").split(",")
    if os.environ.get("HPCRL_RESTART", "0") in runs:
        time.sleep(float(os.environ.get("SLOW_REWARD_S_PER_ROW", "0")))
    return toy_digits_score(solution_str)
