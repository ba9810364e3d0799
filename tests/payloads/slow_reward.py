"""Reward for the requeue lab tests: the toy task's own score, after a pause of
`SLOW_REWARD_S_PER_ROW` seconds per row (default 0), so that a step takes a known time and a
short Slurm time limit falls in the middle of a run. The pause changes no number."""

import os
import time

from trainer.rewards.toy import toy_digits_score


def compute_score(data_source, solution_str, ground_truth, extra_info=None):  # noqa: ANN001, ANN201
    time.sleep(float(os.environ.get("SLOW_REWARD_S_PER_ROW", "0")))
    return toy_digits_score(solution_str)
