"""What a job step learns from Slurm: host lists and the job context.

Pure functions from text (or an environment mapping) to data; nothing here runs a command.
Without `SLURM_JOB_ID` the context describes a single-node "local" job on this machine.
"""

from __future__ import annotations

import re
import secrets
import socket
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
_LAST_NUMBER = re.compile(r"^(.*?)(\d+)(\D*)$")


class HostListError(ValueError):
    """A Slurm host list that cannot be expanded."""


def _split_top_level(text: str) -> list[str]:
    """Split `text` on commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise HostListError(
                    f"host list `{text}` has nested brackets at position {i}; "
                    "Slurm ranges are flat, e.g. `node[1-3,7]`"
                )
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise HostListError(f"host list `{text}` has an unmatched `]` at position {i}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise HostListError(f"host list `{text}` has an unclosed `[`; close every range with `]`")
    parts.append(text[start:])
    return parts


def _expand_range(body: str, whole: str) -> list[str]:
    """`01-03,7` -> ['01', '02', '03', '7']; the width of each low bound is kept."""
    out: list[str] = []
    for item in body.split(","):
        m = _RANGE.match(item.strip())
        if not m:
            raise HostListError(
                f"host list `{whole}` has the range item `{item}`; "
                "each item must be a number or `low-high`, e.g. `[01-04,07]`"
            )
        lo_text, hi_text = m.group(1), m.group(2)
        lo = int(lo_text)
        hi = int(hi_text) if hi_text is not None else lo
        if hi < lo:
            raise HostListError(
                f"host list `{whole}` has the reversed range `{item}`; write `{hi_text}-{lo_text}`"
            )
        width = len(lo_text)
        out.extend(str(n).zfill(width) for n in range(lo, hi + 1))
    return out


def _expand_one(term: str, whole: str) -> list[str]:
    """Expand one comma-free term such as `rack[1-2]-node[01-02]` (cartesian, left outermost)."""
    results = [""]
    rest = term
    while rest:
        open_at = rest.find("[")
        if open_at < 0:
            if "]" in rest:
                raise HostListError(f"host list `{whole}` has an unmatched `]` in `{term}`")
            results = [r + rest for r in results]
            break
        close_at = rest.find("]", open_at)
        literal, body = rest[:open_at], rest[open_at + 1 : close_at]
        if not body:
            raise HostListError(f"host list `{whole}` has an empty range `[]` in `{term}`")
        values = _expand_range(body, whole)
        results = [r + literal + v for r in results for v in values]
        rest = rest[close_at + 1 :]
    return results


def expand_hostlist(text: str) -> list[str]:
    """Expand a Slurm host list (`gpu-[01-04,07],cpu7`) into host names, in order.

    Zero padding follows the low bound of each range (`[08-10]` -> 08, 09, 10); several ranges
    in one name expand as a cartesian product (`r[1-2]-n[1-2]` -> r1-n1, r1-n2, r2-n1, r2-n2).
    """
    text = text.strip()
    if not text:
        raise HostListError("the host list is empty; expected e.g. `node[1-3]` or `node1,node2`")
    hosts: list[str] = []
    for term in _split_top_level(text):
        term = term.strip()
        if not term:
            raise HostListError(f"host list `{text}` has an empty entry (two commas in a row?)")
        hosts.extend(_expand_one(term, text))
    return hosts


@dataclass
class _Group:
    prefix: str
    suffix: str
    width: int
    numbers: list[int] = field(default_factory=list)

    def accepts(self, prefix: str, digits: str, suffix: str) -> bool:
        return (
            prefix == self.prefix
            and suffix == self.suffix
            and str(int(digits)).zfill(self.width) == digits
        )

    def render(self) -> str:
        if len(self.numbers) == 1:
            return f"{self.prefix}{str(self.numbers[0]).zfill(self.width)}{self.suffix}"
        items, i = [], 0
        while i < len(self.numbers):
            j = i
            while j + 1 < len(self.numbers) and self.numbers[j + 1] == self.numbers[j] + 1:
                j += 1
            lo = str(self.numbers[i]).zfill(self.width)
            hi = str(self.numbers[j]).zfill(self.width)
            items.append(lo if i == j else f"{lo}-{hi}")
            i = j + 1
        return f"{self.prefix}[{','.join(items)}]{self.suffix}"


def compress_hostlist(hosts: Iterable[str]) -> str:
    """Write host names as a Slurm host list; `expand_hostlist` gives them back in order.

    Neighbours that differ only in their last number share one bracket (`node[1-3,7]`).
    """
    out: list[str | _Group] = []
    for host in hosts:
        if not host or any(c in host for c in "[],") or host != host.strip():
            raise HostListError(
                f"host name `{host}` cannot go into a host list; names may not be empty "
                "or contain `[`, `]`, `,` or surrounding spaces"
            )
        m = _LAST_NUMBER.match(host)
        if not m:
            out.append(host)
            continue
        prefix, digits, suffix = m.groups()
        last = out[-1] if out else None
        if isinstance(last, _Group) and last.accepts(prefix, digits, suffix):
            last.numbers.append(int(digits))
        else:
            out.append(_Group(prefix, suffix, len(digits), [int(digits)]))
    return ",".join(x if isinstance(x, str) else x.render() for x in out)


@dataclass(frozen=True)
class JobContext:
    """Where this node agent stands in its job, read from the Slurm environment."""

    job_id: str
    """Slurm job id (`SLURM_JOB_ID`), or a generated `local-...` id outside Slurm."""
    array_job_id: str | None
    """`SLURM_ARRAY_JOB_ID` for array jobs, else None."""
    array_task_id: int | None
    """`SLURM_ARRAY_TASK_ID` for array jobs, else None."""
    nodes: tuple[str, ...]
    """Host names of the allocation in Slurm's order; `nodes[0]` hosts the Ray head."""
    node_rank: int
    """Index of this node in `nodes` (`SLURM_NODEID`)."""
    restart: int
    """How often the job was requeued (`SLURM_RESTART_COUNT`, unset on the first run = 0)."""
    run: int
    """This run's index in the run directory (`RUN/<run>/`): the next free one, claimed by the
    job script (`HPCRL_RESTART`) for every run of every job of the run directory, so a job
    resumed with `--resume` never meets an earlier job's files; `restart` when unset."""
    end_time: float | None
    """Unix time at which Slurm ends the job (`SLURM_JOB_END_TIME`), None when unknown."""
    local: bool
    """True when no Slurm job was found and the job runs on this machine alone."""

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def is_head(self) -> bool:
        return self.node_rank == 0

    @property
    def hostname(self) -> str:
        return self.nodes[self.node_rank]


class SlurmEnvError(ValueError):
    """The Slurm environment of a job step is inconsistent or incomplete."""


def _int_var(env: Mapping[str, str], name: str, default: int | None = None) -> int | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw.strip())
    except ValueError:
        raise SlurmEnvError(
            f"`{name}` is `{raw}`, expected a whole number; run the agent inside a Slurm job "
            "step (`srun`) or unset the variable"
        ) from None


def new_local_job_id() -> str:
    """A short unique id for a job outside Slurm (short: it names a socket directory)."""
    return f"local-{secrets.token_hex(4)}"


def job_context(
    env: Mapping[str, str],
    hostname: Callable[[], str] = socket.gethostname,
    new_job_id: Callable[[], str] = new_local_job_id,
    end_time_reader: Callable[[str], float | None] | None = None,
) -> JobContext:
    """Read the job context from `env`.

    `end_time_reader(job_id)` is the place to ask Slurm (`scontrol show job`) for the end time
    when `SLURM_JOB_END_TIME` is not exported; without it the end time is that variable or None.
    Outside Slurm (`SLURM_JOB_ID` unset) the job is local: one node, rank 0, id from
    `HPCRL_JOB_ID` or `new_job_id()`, restart from `HPCRL_RESTART` (default 0). Under Slurm the
    run's index in the run directory is `HPCRL_RESTART` (claimed by the batch script), else
    `SLURM_RESTART_COUNT`.
    """
    job_id = (env.get("SLURM_JOB_ID") or "").strip()
    if not job_id:
        return JobContext(
            job_id=(env.get("HPCRL_JOB_ID") or "").strip() or new_job_id(),
            array_job_id=None,
            array_task_id=None,
            nodes=(hostname(),),
            node_rank=0,
            restart=_int_var(env, "HPCRL_RESTART", 0) or 0,
            run=_int_var(env, "HPCRL_RESTART", 0) or 0,
            end_time=None,
            local=True,
        )
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise SlurmEnvError(
            f"Slurm job `{job_id}` has no `SLURM_JOB_NODELIST`; start the agent with `srun` "
            "inside the allocation"
        )
    nodes = tuple(expand_hostlist(nodelist))
    rank = _int_var(env, "SLURM_NODEID")
    if rank is None:
        raise SlurmEnvError(
            f"Slurm job `{job_id}` has no `SLURM_NODEID`; start one agent per node with "
            "`srun --ntasks-per-node=1`"
        )
    if not 0 <= rank < len(nodes):
        raise SlurmEnvError(
            f"`SLURM_NODEID`={rank} is outside the {len(nodes)} nodes of `{nodelist}`"
        )
    declared = _int_var(env, "SLURM_JOB_NUM_NODES", _int_var(env, "SLURM_NNODES"))
    if declared is not None and declared != len(nodes):
        raise SlurmEnvError(
            f"`SLURM_JOB_NUM_NODES`={declared} but `SLURM_JOB_NODELIST`=`{nodelist}` names "
            f"{len(nodes)} nodes; the environment is inconsistent"
        )
    end = _int_var(env, "SLURM_JOB_END_TIME")
    end_time = float(end) if end else (end_time_reader(job_id) if end_time_reader else None)
    restart = _int_var(env, "SLURM_RESTART_COUNT", 0) or 0
    return JobContext(
        job_id=job_id,
        array_job_id=(env.get("SLURM_ARRAY_JOB_ID") or None),
        array_task_id=_int_var(env, "SLURM_ARRAY_TASK_ID"),
        nodes=nodes,
        node_rank=rank,
        restart=restart,
        run=_int_var(env, "HPCRL_RESTART", restart) or 0,
        end_time=end_time,
        local=False,
    )
