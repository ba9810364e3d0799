"""A SandboxFusion `run_code` service on loopback for the tests: it runs the posted Python code in a
fresh interpreter with the posted `stdin`, `run_timeout` and `memory_limit_MB`, and answers in
SandboxFusion's `RunCodeResponse` shape (`status` `Success` when the run finished with exit code
0, else `Failed`; `run_result` with `status` `Finished`/`TimeLimitExceeded`, `return_code`,
`stdout`, `stderr`, `execution_time`; python has no `compile_result`). `mode` makes it answer
every request with a 504 (`"504"`) or never (`"hang"`); `hold_until` holds each request until that
many have been in flight at once (or 60 s), to show requests are sent together."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def run_code(body: dict[str, Any]) -> dict[str, Any]:
    if body.get("language") != "python":
        return {"status": "SandboxError", "message": f"language {body.get('language')} not served here",
                "compile_result": None, "run_result": None}
    limit = int(body.get("memory_limit_MB") or 1024) * 1024 * 1024

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    start = time.monotonic()
    with tempfile.TemporaryDirectory() as cwd:
        try:
            done = subprocess.run([sys.executable, "-I", "-c", body["code"]], input=body.get("stdin") or "",
                                  capture_output=True, text=True, timeout=float(body["run_timeout"]), cwd=cwd,
                                  preexec_fn=cap, check=False)
            run = {"status": "Finished", "return_code": done.returncode, "stdout": done.stdout,
                   "stderr": done.stderr}
        except subprocess.TimeoutExpired as e:
            run = {"status": "TimeLimitExceeded", "return_code": None,
                   "stdout": (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""),
                   "stderr": ""}
    run["execution_time"] = time.monotonic() - start
    ok = run["status"] == "Finished" and run["return_code"] == 0
    return {"status": "Success" if ok else "Failed", "message": "", "compile_result": None, "run_result": run,
            "executor_pod_name": None, "files": {}}


class SandboxFusionServer:
    def __init__(self, mode: str = "run", hold_until: int = 0) -> None:
        self.requests: list[dict[str, Any]] = []
        self.in_flight = self.most_in_flight = 0
        self.lock = threading.Condition()
        self.release = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    outer.requests.append(body)
                    outer.in_flight += 1
                    outer.most_in_flight = max(outer.most_in_flight, outer.in_flight)
                    outer.lock.notify_all()
                    outer.lock.wait_for(lambda: outer.most_in_flight >= hold_until, timeout=60)
                try:  # counted out before the answer is sent: the client may send the next at once
                    if mode == "hang":
                        outer.release.wait(60)
                    data = None if mode != "run" or self.path != "/run_code" else json.dumps(run_code(body)).encode()
                finally:
                    with outer.lock:
                        outer.in_flight -= 1
                if mode == "hang":
                    return
                if data is None:
                    self.send_error(504 if mode == "504" else 404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/run_code"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @contextmanager
    def running(self) -> Iterator[SandboxFusionServer]:
        self.thread.start()
        try:
            yield self
        finally:
            self.release.set()
            self.httpd.shutdown()
            self.httpd.server_close()
