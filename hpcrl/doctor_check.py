"""The payload of `hpcrl doctor`: run on the job's head as a Ray driver (in the site's container),
it checks the day-one faults on every node and writes `RUN/doctor.json`, one row per check:
`{"check", "status" (PASS/FAIL/SKIP), "detail", "fix"}`.

`python -m hpcrl.doctor_check --runtime R --nodes N --gpus G --vendor V --gpu-gib M
--floor-gbps F [--model DIR]`. The parsers and the rows are pure functions; torch, Ray and vLLM
are imported inside the functions that run on the nodes.
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import re
import socket
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hpcrl.doctor_record import RESULT, row
from hpcrl.runtimes import running_in
from trainer.agent.tools.sandbox import (
    SandboxError,
    SandboxLimits,
    probe,
    sandbox_mode,
    usable_python,
)

MIB = 1 << 20
GIB = 1 << 30
ALLREDUCE_BYTES = 64 * MIB
# The oldest driver each CUDA major runs on (CUDA's minor-version compatibility; the CUDA
# release notes, table 2): a newer toolkit minor needs no newer driver within its major.
CUDA_MIN_DRIVER = {11: (450, 80), 12: (525, 60), 13: (580, 0)}



# ----------------------------------------------------------------------------- parsers


def parse_nccl_transport(log: str) -> str | None:
    """The inter-node transport NCCL/RCCL chose, from its `NCCL_DEBUG=INFO` log: `IB` (InfiniBand
    or RoCE) or `Socket`, None when the log names none. The channels' `via NET/X` lines and
    `Using network X` decide (`NET/IB : No device found` also names NET/IB, then falls back)."""
    used = re.findall(r"via NET/(IB|Socket)\b|Using network (IB|Socket)\b|NET/(IB|Socket) : Using\b", log)
    names = {a or b or c for a, b, c in used}
    if "Socket" in names:
        return "Socket"  # any channel over sockets is the slow path
    return "IB" if names else None


def bus_bandwidth_gbps(nbytes: int, ranks: int, seconds: float) -> float:
    """nccl-tests' all-reduce bus bandwidth: algbw x 2(n-1)/n, in GB/s."""
    return nbytes / seconds * 2 * (ranks - 1) / ranks / 1e9


def parse_nvidia_driver(text: str) -> tuple[int, ...] | None:
    """`/proc/driver/nvidia/version` -> the kernel module's version, e.g. (550, 54, 15)."""
    m = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", text)
    return tuple(int(x) for x in m.group(1).split(".")) if m else None


def cuda_driver_problem(cuda: str, driver: tuple[int, ...]) -> str | None:
    """Why torch built for CUDA `cuda` cannot run on the NVIDIA `driver`, or None."""
    need = CUDA_MIN_DRIVER.get(int(cuda.split(".")[0]))
    if need is None:
        return f"CUDA {cuda} is not in hpcrl's table; check NVIDIA's compatibility table"
    if tuple(driver[:2]) < need:
        return (f"CUDA {cuda} needs driver >= {'.'.join(map(str, need))}, the host has "
                f"{'.'.join(map(str, driver))}")
    return None


# ----------------------------------------------------------------------------- rows


def check_nodes(reports: Sequence[Mapping[str, Any]], runtime: str, vendor: str | None,
                gpu_gib: float) -> list[dict[str, str]]:
    """Rows for what each node's process saw (:func:`node_report`)."""
    where = sorted({r["container"] for r in reports})
    rows = [row("container starts on every node", where == [runtime], f"{len(reports)} node(s) in "
                f"{', '.join(where)}", f"`container.runtime` is {runtime}: check the image and "
                "the runtime on the nodes (`hpcrl logs RUN`)")]
    for r in reports:
        rows += _gpu_rows(r, vendor, gpu_gib)
    return rows


def _gpu_rows(r: Mapping[str, Any], vendor: str | None, gpu_gib: float) -> list[dict[str, str]]:
    host, devices, granted = r["hostname"], r["devices"], r["granted"]
    seen = "HIP" if r["hip"] else "CUDA" if r["cuda"] else "CPU"
    names = sorted({d["name"] for d in devices}) or ["none"]
    mem = min((d["memory_gib"] for d in devices), default=0.0)
    want_api = {"amd": "HIP", "nvidia": "CUDA"}.get(vendor or "", seen)
    ok = len(devices) == granted and (not granted or seen == want_api)
    rows = [row(f"{host}: GPUs torch sees = granted", ok,
                f"{len(devices)} x {', '.join(names)} ({mem:g} GiB) via {seen}, granted {granted}; "
                f"torch {r['torch']}, HIP {r['hip']}, CUDA {r['cuda']}",
                "the container does not reach the GPUs: rootless podman needs `--group-add "
                "keep-groups` (crun), apptainer `gpu: rocm|nv`; an image built for the other "
                "vendor, or a HIP/CUDA the host driver cannot run, sees none")]
    if granted and devices:
        rows.append(row(f"{host}: a kernel runs on every GPU", r["kernel_ok"], r["kernel"],
                        "torch cannot run on these GPUs: an image whose torch/HIP/CUDA does not "
                        "suit the host driver or this GPU's architecture (PYTORCH_ROCM_ARCH)"))
        rows.append(row(f"{host}: GPU memory vs the profile", mem >= 0.95 * gpu_gib,
                        f"{mem:g} GiB per GPU, `slurm.gpu_memory_gib` {gpu_gib:g}",
                        f"the memory plan assumes more than the GPUs have: set "
                        f"`slurm.gpu_memory_gib: {int(mem)}`"))
    if r.get("driver_problem") is not None:
        rows.append(row(f"{host}: image's CUDA vs the host driver", not r["driver_problem"],
                        r["driver_problem"] or f"driver {r['driver']}", "use an image built for an "
                        "older CUDA, or ask for a newer driver"))
    host_gib = r["memory_bytes"] / GIB
    need = granted * mem
    rows.append(row(f"{host}: host RAM vs the GPUs' memory", None if not granted else host_gib >= need,
                    f"the job's memory here {host_gib:.1f} GiB (Ray's, from Slurm and the cgroup), GPUs "
                    f"{need:g} GiB" + ("" if granted else ": no GPU") + " (a rule of thumb; the memory "
                    "plan row checks a given command line against this memory)",
                    "vLLM's sleep and FSDP's offload keep weights and optimizer state in host RAM: "
                    "ask Slurm for more (`slurm.mem`, `0` for all) or keep offload off; give the job's "
                    "command line after `--` to have its host memory planned"))
    return rows


NODE_MARKS = "doctor-nodes"
MIN_PYTHON = (3, 11)


def prerequisite_rows(reports: Sequence[Mapping[str, Any]], run_dir: Path) -> list[dict[str, str]]:
    """The cluster path's prerequisites (docs/quickstart-cluster.md): the interpreter the nodes'
    payload processes run (the image's in a container), alike on every node and new enough; and
    the run directory one filesystem for all: each node left a file in it (:func:`node_report`),
    which this head must see. The agents' own interpreter is met once every node has joined Ray
    (the `Ray: every node joined` row): an agent that cannot start never joins."""
    pythons = sorted({(r.get("python"), r.get("python_version")) for r in reports})
    versions_ok = all(tuple(int(x) for x in str(v).split(".")[:2]) >= MIN_PYTHON for _, v in pythons if v)
    same = len(pythons) == 1 and pythons[0][0] is not None
    detail = "; ".join(f"{path} (Python {version}) on " + ", ".join(sorted(r["hostname"] for r in reports
                       if (r.get("python"), r.get("python_version")) == (path, version)))
                       for path, version in pythons)
    rows = [row("the payload's interpreter: one on every node, Python >= 3.11", same and versions_ok, detail,
                "every node must run the payload with one interpreter, Python 3.11 or newer: in a container "
                "the image's (rebuild it, `hpcrl image build`); with `container.runtime: none` the site "
                "profile's `python:`, else the one `hpcrl submit` ran with (install it at that path on every "
                "node, or set `python:` to one every node has)")]
    marks = run_dir / NODE_MARKS
    seen = {p.name for p in marks.iterdir()} if marks.is_dir() else set()
    missing = sorted(r["hostname"] for r in reports if r["hostname"] not in seen)
    rows.append(row("run directory shared by every node", not missing,
                    f"{len(reports) - len(missing)} of {len(reports)} node(s) wrote a file this head sees under {marks}"
                    + (f"; not seen: {', '.join(missing)}" if missing else ""),
                    "`run_root` must be on a filesystem that the login node and every compute node mount at the "
                    "same path (a parallel or NFS filesystem, not a node's /tmp)"))
    return rows


def allreduce_rows(results: Sequence[Mapping[str, Any]], floor_gbps: float,
                   nccl_log: str) -> list[dict[str, str]]:
    seconds = max(o["seconds"] for o in results)
    gbps = bus_bandwidth_gbps(ALLREDUCE_BYTES, len(results), seconds)
    backend = results[0]["backend"]
    transport = parse_nccl_transport(nccl_log) if backend == "nccl" else "TCP (gloo, CPU)"
    return [
        row("all-reduce across nodes: result", all(o["sum_ok"] for o in results),
            f"{backend}, {len(results)} ranks (one per node)", "ranks disagree: a broken NIC or driver"),
        row("all-reduce across nodes: bus bandwidth", gbps >= floor_gbps,
            f"{gbps:.2f} GB/s for 64 MiB (floor {floor_gbps:g} GB/s, `doctor.allreduce_floor_gbps`)",
            "below the floor: see the transport row; check `NCCL_IB_HCA` and the HCAs' state"),
        row("all-reduce across nodes: transport", None if backend != "nccl" else transport == "IB",
            f"{transport or 'not named in the NCCL/RCCL log'}" + (" (NCCL/RCCL's own log)" if backend == "nccl" else ""),
            "NCCL/RCCL use sockets between nodes: set `NCCL_IB_HCA` to the HCAs `hpcrl sites new` "
            "proposes and pass /dev/infiniband into the container"),
    ]


# ----------------------------------------------------------------------------- on the nodes


def _host_driver() -> tuple[str | None, str | None]:
    """(driver version, problem with torch's CUDA) for NVIDIA; (amdgpu version, None) for AMD."""
    import torch

    try:
        nv = parse_nvidia_driver(Path("/proc/driver/nvidia/version").read_text())
    except OSError:
        nv = None
    if nv and torch.version.cuda:
        return ".".join(map(str, nv)), cuda_driver_problem(torch.version.cuda, nv) or ""
    try:
        return Path("/sys/module/amdgpu/version").read_text().strip(), None
    except OSError:
        return None, None


def node_report(gpus_granted: int, run_dir: str | None = None) -> dict[str, Any]:
    """What one node's process sees: container, torch, its GPUs (a matmul on each), its memory,
    its interpreter; with `run_dir`, it leaves a file there named after the node
    (`doctor-nodes/<host>`), which the head then looks for (:func:`prerequisite_rows`)."""
    import platform
    import sys

    import torch

    if run_dir:
        marks = Path(run_dir) / NODE_MARKS
        marks.mkdir(parents=True, exist_ok=True)
        (marks / socket.gethostname()).write_text(f"{os.getpid()}\n")

    devices, kernel, kernel_ok = [], "no GPU", True
    for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        props = torch.cuda.get_device_properties(i)
        devices.append({"name": props.name, "memory_gib": round(props.total_memory / GIB, 1)})
        try:
            x = torch.ones(256, 256, device=f"cuda:{i}")
            kernel_ok = kernel_ok and float((x @ x)[0, 0]) == 256.0
            kernel = f"256x256 matmul on {i + 1} GPU(s)"
        except RuntimeError as exc:
            kernel_ok, kernel = False, f"GPU {i}: {str(exc).splitlines()[0]}"
    driver, problem = _host_driver()
    return {"hostname": socket.gethostname(), "container": running_in(), "torch": torch.__version__,
            "hip": torch.version.hip, "cuda": torch.version.cuda, "devices": devices,
            "granted": gpus_granted, "kernel": kernel, "kernel_ok": kernel_ok, "driver": driver,
            "driver_problem": problem, "python": sys.executable, "python_version": platform.python_version()}


def allreduce_rank(rank: int, world: int, master: str, port: int, run_dir: str) -> dict[str, Any]:
    """One rank of the timed all-reduce (NCCL/RCCL on a GPU, gloo otherwise); NCCL/RCCL log to
    `RUN/nccl-HOST-PID.log`, where the transport is read from."""
    os.environ.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,NET",
                      NCCL_DEBUG_FILE=f"{run_dir}/nccl-%h-%p.log")
    import torch
    import torch.distributed as dist

    gpu = torch.cuda.is_available()
    dist.init_process_group("nccl" if gpu else "gloo", init_method=f"tcp://{master}:{port}",
                            rank=rank, world_size=world)
    try:
        x = torch.ones(ALLREDUCE_BYTES // 4, dtype=torch.float32, device="cuda" if gpu else "cpu")
        dist.all_reduce(x)  # the first one sets up the connections: not timed
        sync = torch.cuda.synchronize if gpu else (lambda: None)
        sync()
        t0 = time.perf_counter()
        for _ in range(3):
            dist.all_reduce(x)
        sync()
        seconds = (time.perf_counter() - t0) / 3
        return {"backend": dist.get_backend(), "seconds": seconds, "sum_ok": float(x[0]) == world ** 4}
    finally:
        dist.destroy_process_group()


def generate_once(model: str, max_model_len: int = 256) -> str:
    """vLLM loads `model` and generates 8 tokens (on the GPU Ray gave this task; vLLM's CPU
    backend where there is none), then shuts its engine down: the engine core and its workers are
    processes of their own, which would otherwise hold the GPU's memory for as long as Ray keeps
    this task's worker process (Ray reuses it for the checks that follow)."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, enforce_eager=True, max_model_len=max_model_len, gpu_memory_utilization=0.3)
    try:
        out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0.0))
        return out[0].outputs[0].text
    finally:
        llm.llm_engine.engine_core.shutdown()


def _per_node(fn: Any, nodes: Sequence[Mapping[str, Any]], *args: Any, gpus: int = 0) -> list[Any]:
    """`fn` once on every node. Its GPUs are asked of Ray (`gpus`): Ray gives a task its GPUs
    through `CUDA_VISIBLE_DEVICES`/`HIP_VISIBLE_DEVICES`, so a task asking none may see none."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0, num_gpus=gpus)(fn)
    return ray.get([task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
                    .remote(*[a(i) if callable(a) else a for a in args]) for i, n in enumerate(nodes)])


def sandbox_report() -> dict[str, Any]:
    """Whether the python tool's sandbox builds on this node in the site's mode
    (`HPCRL_PYTHON_SANDBOX`, default `strict`), as the trainer would build it: by this user, or
    by `nobody` when this is root; with this interpreter where that user can run it."""
    mode = "strict"
    try:
        mode = sandbox_mode()
        uid = gid = None
        if os.geteuid() == 0:
            entry = pwd.getpwnam("nobody")
            uid, gid = entry.pw_uid, entry.pw_gid
        probe(SandboxLimits(mode=mode, uid=uid, gid=gid, python=usable_python(uid, gid)))
    except (SandboxError, KeyError) as exc:
        return {"mode": mode, "ok": False, "why": str(exc)}
    return {"mode": mode, "ok": True, "why": ""}


def sandbox_row(reports: Sequence[Mapping[str, Any]], nodes: Sequence[str]) -> dict[str, str]:
    """One row for every node's :func:`sandbox_report`. Only agent loops with the `python` tool
    (or SandboxFusion `local`) need the sandbox, so a node that cannot build it is reported, with
    the fix, without failing the doctor: the tool itself refuses to start there."""
    name = "python tool's sandbox builds on every node"
    bad = [f"{node}: {r['why']}" for r, node in zip(reports, nodes, strict=True) if not r["ok"]]
    modes = sorted({str(r["mode"]) for r in reports})
    if bad:
        return row(name, None, "; ".join(bad)[:600] + " -- only the `python` tool needs it; fix: under "
                   "Podman add `container.security_opt: [\"unmask=/proc/*\"]`, else ask the admins for "
                   "unprivileged user namespaces, or name `HPCRL_PYTHON_SANDBOX: rlimits` in the profile's "
                   "`env:` (docs/agent-loops.md, 'The python tool's sandbox')")
    return row(name, True, f"mode {', '.join(modes)} on {len(reports)} node(s)")


def check_sandbox(alive: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    return sandbox_row(_per_node(sandbox_report, alive), [n["NodeManagerAddress"] for n in alive])


def check_ray(want: int) -> tuple[list[dict[str, str]], list[dict[str, Any]]]:
    import ray

    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    alive = [n for n in ray.nodes() if n["Alive"]]
    return [row("Ray: every node joined (with the job's token)", len(alive) == want,
                f"{len(alive)} of {want} nodes alive at {os.environ['RAY_ADDRESS']}",
                "see RUN/*/logs/agent-*.log of the missing nodes (firewall, `network.interface`)")], alive


def check_allreduce(alive: Sequence[Mapping[str, Any]], gpus: int, floor_gbps: float,
                    run_dir: Path) -> list[dict[str, str]]:
    if len(alive) < 2:
        return [row("all-reduce across nodes", None, "one node: nothing crosses the network")]
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    out = _per_node(allreduce_rank, alive, lambda i: i, len(alive), alive[0]["NodeManagerAddress"],
                    port, str(run_dir), gpus=min(gpus, 1))
    log = "".join(p.read_text(errors="replace") for p in run_dir.glob("nccl-*.log"))
    return allreduce_rows(out, floor_gbps, log)


def check_vllm(alive: Sequence[Mapping[str, Any]], gpus: int, model: str | None) -> dict[str, str]:
    name = "vLLM loads and generates on one GPU"
    if not gpus:
        return row(name, None, "no GPU granted")
    if not model:
        return row(name, None, "no model: pass `hpcrl doctor --model DIR`")
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        return row(name, None, f"vllm is not installed in the image ({exc})")
    try:
        (text,) = _per_node(generate_once, alive[:1], model, gpus=1)
    except Exception as exc:  # noqa: BLE001 - any failure of the engine is the finding
        return row(name, False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}",
                   "vLLM cannot start on this GPU: its build must match the image's torch and the GPU")
    return row(name, bool(text), f"8 tokens: {text!r}", "vLLM generated nothing")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hpcrl.doctor_check")
    p.add_argument("--runtime", required=True)
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--gpus", type=int, default=0)
    p.add_argument("--vendor", choices=["amd", "nvidia", "any"], default="any")
    p.add_argument("--gpu-gib", type=float, default=0.0)
    p.add_argument("--floor-gbps", type=float, default=0.0)
    p.add_argument("--model")
    args = p.parse_args(argv)
    run_dir = Path(os.environ["HPCRL_RUN_DIR"])
    rows, alive = check_ray(args.nodes)
    reports = _per_node(node_report, alive, args.gpus, str(run_dir), gpus=args.gpus)
    for report, node in zip(reports, alive, strict=True):  # what the agent gave Ray on the node
        report["memory_bytes"] = sum(node["Resources"].get(k, 0) for k in ("memory", "object_store_memory"))
    rows += check_nodes(reports, args.runtime, None if args.vendor == "any" else args.vendor, args.gpu_gib)
    rows += prerequisite_rows(reports, run_dir)
    rows += check_allreduce(alive, args.gpus, args.floor_gbps, run_dir)
    rows.append(check_sandbox(alive))
    rows.append(check_vllm(alive, args.gpus, args.model))
    tmp = run_dir / (RESULT + ".tmp")
    tmp.write_text(json.dumps({"rows": rows, "reports": reports}, indent=1))
    tmp.replace(run_dir / RESULT)
    return 1 if any(r["status"] == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
