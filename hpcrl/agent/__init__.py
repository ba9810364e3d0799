"""The node agent: one per node of a job, bringing up Ray and running the payload.

Run as `python -m hpcrl.agent RUN_DIR` (one Slurm task per node, on the host). Without
`SLURM_JOB_ID` it runs a single-node local job (`HPCRL_JOB_ID`, `HPCRL_RESTART` optional).
Under Slurm, `HPCRL_RESTART` is the run directory `RUN/<N>/` the job script claimed for this run
(the next free one); an agent refuses an `<N>/` of another job, and the head holds the run
directory's lease (`hpcrl.agent.lease`) while it runs.
If the submitting side exported `HPCRL_CANARY` (see `rendezvous.write_canary`), every node
checks that it sees the same run directory.

The payload runs on the head once every node joined, or, for the trainer (job.json
`payload_start: head-alive`), once the head's own Ray is up: its start-up then overlaps the
other nodes' joining, which its placement group waits for. It gets: `RAY_ADDRESS` (explicit, `[v6]:port` for IPv6),
`MASTER_ADDR` (bare), `RAY_AUTH_MODE=token`, `RAY_AUTH_TOKEN_PATH`, `HPCRL_RUN_DIR`,
`HPCRL_RESTART`, `HPCRL_JOB_ID`, `HPCRL_NUM_NODES`, `HPCRL_JOIN_TIMEOUT_S`, `GLOO_SOCKET_IFNAME`/`NCCL_SOCKET_IFNAME`
and the profile's `env`. SIGTERM, SIGUSR1 and SIGUSR2 sent to the agent reach the payload; its
exit status becomes the job's.

Importing this package imports no Ray.
"""
