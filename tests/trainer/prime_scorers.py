"""Reward functions for the `prime` manager's tests, loaded by path as `custom_reward_function.path`
loads them (hpcrl) and by verl's side of the differential test."""


def exact(data_source, solution_str, ground_truth, extra_info=None):
    """1 for the right answer, raises on a response that says "boom", a bool for "yes"/"no", a
    tuple for "pair" (its first item is the score)."""
    if "boom" in solution_str:
        raise RuntimeError("the scorer failed on this row")
    if solution_str in ("yes", "no"):
        return solution_str == "yes"
    if solution_str == "pair":
        return (0.25, "unused")
    bonus = 0.5 if (extra_info or {}).get("bonus") else 0.0
    return float(solution_str.strip() == str(ground_truth)) + bonus + (0.125 if data_source == "b" else 0.0)


def slow(data_source, solution_str, ground_truth, extra_info=None):
    """Never returns for "hang" (a call that must not outlive the deadline)."""
    import time

    if solution_str == "hang":
        time.sleep(3600)
    return 1.0


def as_dict(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 1.0}


def term_default(data_source, solution_str, ground_truth, extra_info=None):
    """1 when SIGTERM ends this worker (its default action), 0 when a handler would catch it."""
    import signal

    return float(signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)
