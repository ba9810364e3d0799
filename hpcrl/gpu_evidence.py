"""A node's GPUs as evidence when the trainer's watchdog fires: uncorrected ECC errors and failed
row remapping (`nvidia-smi`), uncorrectable ECC counts (`amd-smi`), and the kernel log's GPU
errors since the run started (NVIDIA `Xid`s, amdgpu's uncorrectable RAS errors, ring timeouts and
resets; `journalctl -k` or `dmesg`, whichever this user may read).

A node with an uncorrected ECC error, a failed row remap, an Xid or an amdgpu hardware error is a
suspect: the head agent requeues the job without it (:func:`hpcrl.diagnosis.blamed_nodes`). A
node where none of these tools answers gives no evidence (`no GPU tools on <node>`), and nothing
is done on its account.

The parsers are pure functions from a tool's text to data; one function runs the commands
(:func:`run_command`, the seam a test replaces). Standard library only (the watchdog runs this on
each node, the launcher may on a login node).
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
from collections.abc import Callable
from datetime import datetime
from typing import Any

__all__ = ["AMD_SMI", "NVIDIA_FIELDS", "NVIDIA_SMI", "Runner", "kernel_log_commands", "node_evidence",
           "parse_amd_smi", "parse_kernel_log", "parse_nvidia_smi", "run_command", "suspect_reasons"]

NVIDIA_FIELDS = ("index", "pci.bus_id", "ecc.errors.uncorrected.volatile.total", "remapped_rows.failure")
"""What `nvidia-smi --query-gpu` is asked (Xid is not a queryable field: the kernel log has it)."""
NVIDIA_SMI = ["nvidia-smi", f"--query-gpu={','.join(NVIDIA_FIELDS)}", "--format=csv,noheader,nounits"]
AMD_SMI = ["amd-smi", "metric", "--ecc", "--json"]

Runner = Callable[[list[str]], "tuple[int, str] | None"]
"""Runs a command: (exit status, stdout and stderr), or None when the program is not installed."""


def run_command(argv: list[str], timeout: float = 10.0) -> tuple[int, str] | None:
    """Run `argv` here: (exit status, its output), None when the program is not on PATH. A tool
    that does not answer within `timeout` is killed and not waited for: `nvidia-smi` on a GPU
    that fell off the bus can hang in uninterruptible sleep, where even SIGKILL waits."""
    if shutil.which(argv[0]) is None:
        return None
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except OSError as err:
        return 126, str(err)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        try:
            proc.communicate(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass  # still in the kernel: left behind rather than waited for
        return 124, f"`{argv[0]}` did not answer within {timeout:g} s"
    return proc.returncode, out


def _count(value: str) -> int | None:
    """A counter's value, None where the tool has none (`[N/A]`, `[Not Supported]`, `N/A`)."""
    try:
        return int(str(value).strip())
    except ValueError:
        return None


def parse_nvidia_smi(text: str) -> list[dict[str, Any]]:
    """`nvidia-smi --query-gpu=<NVIDIA_FIELDS> --format=csv,noheader,nounits` output: per GPU its
    `index`, `bus_id`, `uncorrected` (volatile uncorrected ECC errors since the driver loaded;
    None without ECC) and `remap_failed` (a row remap failed: None where the GPU has no row
    remapping)."""
    out = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(NVIDIA_FIELDS) or _count(cells[0]) is None:
            continue
        remap = cells[3].lower()
        out.append({"index": int(cells[0]), "bus_id": cells[1], "uncorrected": _count(cells[2]),
                    "remap_failed": True if remap == "yes" else False if remap == "no" else None})
    return out


def parse_amd_smi(text: str) -> list[dict[str, Any]]:
    """`amd-smi metric --ecc --json` output (a list of GPUs in ROCm 6, `{"gpu_data": [...]}` in
    ROCm 7): per GPU its `index` and `uncorrected` (`total_uncorrectable_count`; None where
    it says `N/A`)."""
    try:
        data = json.loads(text)
    except ValueError:
        return []
    gpus = data.get("gpu_data", []) if isinstance(data, dict) else data
    out = []
    for gpu in gpus if isinstance(gpus, list) else []:
        ecc = gpu.get("ecc") if isinstance(gpu, dict) else None
        if isinstance(ecc, dict):
            out.append({"index": gpu.get("gpu"), "uncorrected": _count(ecc.get("total_uncorrectable_count", ""))})
    return out


_XID = re.compile(r"NVRM: Xid \((?:PCI:)?(?P<pci>[0-9a-fA-F:.]+)\): (?P<xid>\d+),\s*(?P<text>.*)")
_AMD = re.compile(r"amdgpu.*?(?:(?<!no )(?P<ue>[1-9]\d*) (?:new )?uncorrectable hardware errors detected"
                  r"|\*ERROR\* ring (?P<ring>\S+) timeout(?!, but soft recovered)"
                  r"|(?P<reset>GPU reset begin))")
_ISO = re.compile(r"^(?P<time>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:[,.]\d+)?(?:[+-]\d\d:?\d\d|Z)?)\s")


def _line_time(line: str) -> float | None:
    """The epoch time of a `journalctl -o short-iso` or `dmesg --time-format iso` line."""
    found = _ISO.match(line)
    if not found:
        return None
    stamp = found["time"].replace(",", ".").replace("Z", "+00:00")
    stamp = re.sub(r"([+-]\d\d)(\d\d)$", r"\1:\2", stamp)
    try:
        return datetime.fromisoformat(stamp).timestamp()
    except ValueError:
        return None


def parse_kernel_log(text: str, since: float | None = None) -> list[dict[str, Any]]:
    """The GPU errors in kernel log text: NVIDIA `Xid`s (`xid`, `pci`) and amdgpu's uncorrectable
    hardware errors, ring timeouts (not the soft-recovered ones) and resets (`amdgpu`); each
    with its `line`. With `since` (epoch seconds), lines stamped earlier are left out (lines
    without a time stamp are kept)."""
    out: list[dict[str, Any]] = []
    for line in text.splitlines():
        when = _line_time(line)
        if since is not None and when is not None and when < since:
            continue
        if xid := _XID.search(line):
            out.append({"xid": int(xid["xid"]), "pci": xid["pci"], "line": line.strip()})
        elif amd := _AMD.search(line):
            what = (f"{amd['ue']} uncorrectable hardware errors" if amd["ue"]
                    else f"ring {amd['ring']} timeout" if amd["ring"] else "GPU reset")
            out.append({"amdgpu": what, "line": line.strip()})
    return out


def kernel_log_commands(since: float) -> list[list[str]]:
    """The kernel log since `since`, in the order tried: the journal (which a user in group
    `adm` or `systemd-journal` may read) and the ring buffer (`dmesg`, often root only)."""
    return [["journalctl", "-k", "--no-pager", "-q", "-o", "short-iso", "--since", f"@{int(since)}"],
            ["dmesg", "--time-format", "iso"]]


def suspect_reasons(evidence: dict[str, Any]) -> list[str]:
    """Why the node of `evidence` (:func:`node_evidence`) is a suspect, one sentence each; empty:
    it is not."""
    why = []
    for gpu in evidence.get("nvidia", []):
        if gpu.get("uncorrected"):
            why.append(f"GPU {gpu['index']} ({gpu['bus_id']}) has {gpu['uncorrected']} uncorrected ECC error(s)")
        if gpu.get("remap_failed"):
            why.append(f"GPU {gpu['index']} ({gpu['bus_id']}) failed a row remap")
    for gpu in evidence.get("amd", []):
        if gpu.get("uncorrected"):
            why.append(f"GPU {gpu['index']} has {gpu['uncorrected']} uncorrectable ECC error(s)")
    for err in evidence.get("kernel", []):
        why.append(f"Xid {err['xid']} on GPU {err['pci']}" if "xid" in err else f"amdgpu: {err['amdgpu']}")
    return why


def node_evidence(since: float, run: Runner | None = None, node: str | None = None) -> dict[str, Any]:
    """This node's GPU evidence: `nvidia` and `amd` (per GPU, from the tools present), `kernel`
    (the kernel log's GPU errors since `since`), `tools` (those that answered), `notes` (what
    could not be read, in words), `suspect` (:func:`suspect_reasons`)."""
    run = run or run_command
    node = node or socket.gethostname()
    evidence: dict[str, Any] = {"node": node, "tools": [], "nvidia": [], "amd": [], "kernel": [], "notes": []}
    installed = False
    for argv, parse, key in ((NVIDIA_SMI, parse_nvidia_smi, "nvidia"), (AMD_SMI, parse_amd_smi, "amd")):
        done = run(argv)
        if done is None:
            continue
        installed = True
        status, text = done
        if status == 0:
            evidence[key] = parse(text)
            evidence["tools"].append(argv[0])
        else:
            evidence["notes"].append(f"`{argv[0]}` failed ({status}): {text.strip()[:200]}")
    for argv in kernel_log_commands(since):
        done = run(argv)
        if done is not None and done[0] == 0:
            evidence["kernel"] = parse_kernel_log(done[1], since)
            evidence["tools"].append(argv[0])
            break
    else:
        evidence["notes"].append("the kernel log is not readable here (`journalctl -k`, `dmesg`)")
    if not installed and not evidence["kernel"]:
        evidence["notes"].insert(0, f"no GPU tools on {node}")
    evidence["suspect"] = suspect_reasons(evidence)
    return evidence
