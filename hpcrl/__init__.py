"""hpcrl: Slurm-native batch framework for RL training of language models.

The launcher stays light: importing :mod:`hpcrl` never imports torch, ray or vllm.
"""

from __future__ import annotations

__version__ = "0.1.0"


def agent_entry(run_dir: str) -> int:
    """Run the node agent for `run_dir` in this process: what each submitit task calls.

    Picklable by reference (a module-level function); imports :mod:`hpcrl.agent` only when called.
    Equivalent to ``python -m hpcrl.agent RUN_DIR``; a non-zero exit raises ``SystemExit`` so that
    submitit records the task as failed.
    """
    import runpy
    import sys

    saved = sys.argv
    sys.argv = ["hpcrl.agent", str(run_dir)]
    try:
        runpy.run_module("hpcrl.agent", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if code:
            raise
        return 0
    finally:
        sys.argv = saved
    return 0
