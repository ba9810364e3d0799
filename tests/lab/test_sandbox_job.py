"""The python tool's sandbox where our users run it: a Slurm batch job of an ordinary user
(`nobody`, submitted with `sbatch --uid`), on a lab node whose slurmd runs in its own network,
UTS and mount namespaces. The job builds the `strict` sandbox with only that user's rights and
runs the hostile cases of `tests/trainer/agent/test_sandbox.py` in it; the test reads what each
printed."""

from __future__ import annotations

import json
import pwd
import shutil
import socket
import tempfile
import textwrap
from pathlib import Path

import pytest

from tests.trainer.agent.test_sandbox import FORK_BOMB, MOUNTS, STATUS
from trainer.agent.tools import sandbox

pytestmark = pytest.mark.lab

CASES = {
    "status": STATUS,
    "mounts": MOUNTS.replace("{name}", "hpcrl-lab-escape"),
    "fork": FORK_BOMB,
    "sight": ("import os\nfor t in {secret!r}, '/root', '/etc/shadow', '/run/munge', {sock!r}:\n"
              "    print(t, os.path.exists(t))\nprint(sorted(p for p in os.listdir('/proc') if p.isdigit()))"),
    "socket": ("import socket\ns = socket.socket(socket.AF_UNIX)\ntry:\n    s.connect({sock!r})\n"
               "    print('connected')\nexcept OSError as e:\n    print('refused', e.strerror)"),
    "nested": ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
               "print(libc.unshare(0x10000000), os.strerror(ctypes.get_errno()))"),
    "memory": ("import os, time\nfor _ in range(6):\n    if os.fork() == 0:\n        b = bytearray(180 << 20)\n"
               "        for i in range(0, len(b), 4096):\n            b[i] = 1\n        time.sleep(30); os._exit(0)\n"
               "for _ in range(6):\n    os.wait()\nprint('all held')"),
}

DRIVER = """\
import asyncio, json, os, sys
here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, here)
import sandbox
limits = sandbox.SandboxLimits(python="/usr/bin/python3", memory_limit_mb=256, timeout=30, max_processes=16,
                               tmp_dir=os.path.join(here, "out"))
sandbox.probe(limits)
cases = json.load(open(os.path.join(here, "cases.json")))
with open(os.path.join(here, "out", "results.jsonl"), "w") as f:
    for name, code in cases.items():
        res = asyncio.run(sandbox.run_python(code, limits))
        f.write(json.dumps({"case": name, "uid": os.getuid(), "stdout": res.stdout.decode(),
                            "stderr": res.stderr.decode(), "returncode": res.returncode,
                            "report": res.report}) + "\\n")
print("cases done", len(cases))
"""


def test_the_strict_sandbox_holds_in_a_job_of_an_ordinary_user(lab, tmp_path: Path) -> None:
    nobody = pwd.getpwnam("nobody")
    job_dir = Path(tempfile.mkdtemp(prefix="hpcrl-sandbox-job-"))  # a path `nobody` can reach
    try:
        job_dir.chmod(0o755)
        out = job_dir / "out"
        out.mkdir()
        shutil.chown(out, nobody.pw_uid, nobody.pw_gid)
        for name in ("sandbox.py", "sandbox_launch.py"):
            shutil.copy(Path(sandbox.__file__).with_name(name), job_dir / name)
        secret = job_dir / "secret.txt"
        secret.write_text("the job user's own")
        shutil.chown(secret, nobody.pw_uid, nobody.pw_gid)
        secret.chmod(0o600)
        sock_path = job_dir / "job.sock"
        cases = {k: v.replace("{secret!r}", repr(str(secret))).replace("{sock!r}", repr(str(sock_path)))
                 for k, v in CASES.items()}
        (job_dir / "cases.json").write_text(json.dumps(cases))
        (job_dir / "driver.py").write_text(DRIVER)
        for path in job_dir.iterdir():
            path.chmod(0o755 if path.is_dir() else 0o644)
        with socket.socket(socket.AF_UNIX) as listener:  # the job user's socket, as Ray's would be
            listener.bind(str(sock_path))
            sock_path.chmod(0o777)
            listener.listen(1)
            job = lab.sbatch(textwrap.dedent(f"""\
                #!/bin/bash
                #SBATCH --nodes=1
                #SBATCH --output={out}/slurm-%j.out
                /usr/bin/python3 {job_dir}/driver.py
            """), "--uid=nobody", "--gid=nogroup")
            rec = lab.wait_done(job, timeout=180)
        log = (out / f"slurm-{job}.out").read_text()
        assert rec["JobState"] == "COMPLETED" and "cases done 7" in log, (rec, log)
        results = {r["case"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    finally:
        shutil.rmtree(job_dir, ignore_errors=True)
    assert {r["uid"] for r in results.values()} == {nobody.pw_uid}
    uid, gid, groups, rest = results["status"]["stdout"].split(maxsplit=3)
    # a Slurm job keeps its user's supplementary groups (here nogroup), which an unprivileged
    # user namespace cannot drop (`setgroups` is denied there): said in docs/agent-loops.md
    assert (uid, groups) == (str(nobody.pw_uid), f"[{nobody.pw_gid}]"), results["status"]
    assert rest.split() == ["0000000000000000"] * 5 + ["1"], results["status"]
    mounts = results["mounts"]["stdout"].splitlines()
    assert all(line.endswith("Operation not permitted") for line in mounts[:6]), mounts
    assert all(line.endswith("Read-only file system") for line in mounts[6:9]), mounts
    assert int(results["fork"]["stdout"].split()[1]) < 16
    sight = results["sight"]["stdout"].splitlines()
    assert [line.rsplit(" ", 1)[1] for line in sight[:5]] == ["False"] * 5, sight
    assert sight[5] == "['1', '2']", sight
    assert results["socket"]["stdout"] == "refused No such file or directory\n"
    assert results["nested"]["stdout"] == "-1 No space left on device\n"
    memory = results["memory"]
    assert memory["report"].get("killed") == "memory" and "all held" not in memory["stdout"], memory
