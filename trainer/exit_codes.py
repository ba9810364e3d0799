"""Exit statuses of `python -m trainer` that the launcher acts on.

`REQUEUE_EXIT_CODE` (3): a stop was requested (SIGUSR2, SIGTERM or a `STOP` file in the run
directory); the trainer finished its step, wrote a complete checkpoint and asks to be run again
(the Slurm side requeues the job, the next run resumes from that checkpoint).
"""

OK_EXIT_CODE = 0
#: Bad configuration or input: fix the command line, requeueing will not help.
USAGE_EXIT_CODE = 2
#: Checkpointed after a stop request; please requeue.
REQUEUE_EXIT_CODE = 3
#: The device holding the checkpoints is full (the message names the directory and the fix).
NO_SPACE_EXIT_CODE = 4
#: Aborted by a second interrupt (Ctrl-C) before the step finished; nothing was checkpointed.
ABORTED_EXIT_CODE = 130
#: A distributed worker raised or died (message names node and rank), or Ray was unreachable.
WORKER_FAILURE_EXIT_CODE = 1
