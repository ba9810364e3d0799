"""verl's search tool (Search-R1) and SandboxFusion tool, loaded from verl's own tool files, against
local services on loopback: a retrieval server speaking Search-R1's `retrieval_server.py` API and
a SandboxFusion `run_code` endpoint. The expected texts are verl's formatting, worked by hand from
`search_r1_like_utils.py` (`_passages2string`, `perform_single_search_batch`) and
`sandbox_fusion_tools.py` (`execute_code`)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.trainer.agent.sandbox_support import sandbox_python
from trainer.agent.tools import AgentConfigError, SandboxFusionTool, SearchTool, load_tools
from trainer.agent.tools.http_service import RetryRule, post_json
from trainer.agent.tools.sandbox_fusion import NOT_FINISHED

VERL_SEARCH_TOOL_CONFIG = """\
tools:
  - class_name: verl.tools.search_tool.SearchTool
    config:
      retrieval_service_url: {url}
      num_workers: 120
      rate_limit: 120
      timeout: 30
      type: native
    tool_schema:
      type: function
      function:
        name: search
        description: Searches the web for relevant information based on the given query.
        parameters:
          type: object
          properties:
            query_list:
              type: array
              item:
                type: string
              description: A list of fully-formed semantic queries. The tool will return search results for each query.
          required:
            - query_list
"""

VERL_SANDBOX_FUSION_TOOL_CONFIG = """\
tools:
  - class_name: "verl.tools.sandbox_fusion_tools.SandboxFusionTool"
    config:
      sandbox_fusion_url: "{url}"
      num_workers: 10
      enable_global_rate_limit: true
      rate_limit: 10
      default_timeout: 30
      default_language: "python"
      memory_limit_mb: 1024
      type: native
    tool_schema:
      type: "function"
      function:
        name: "code_interpreter"
        description: "A tool for executing code."
        parameters:
          type: "object"
          properties:
            code:
              type: "string"
              description: "The code to execute."
          required: ["code"]
"""


class Service:
    """A JSON service on loopback: `answer(body) -> (status, reply)`; what it received is kept."""

    def __init__(self, answer: Callable[[Any], tuple[int, Any]]) -> None:
        self.received: list[Any] = []
        service = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                service.received.append(body)
                status, reply = answer(body)
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def service() -> Iterator[Callable[[Callable[[Any], tuple[int, Any]]], Service]]:
    started: list[Service] = []

    def start(answer: Callable[[Any], tuple[int, Any]]) -> Service:
        started.append(Service(answer))
        return started[-1]

    yield start
    for s in started:
        s.close()


CORPUS = {"capital of france": [("Paris\nParis is the capital of France.", 0.9),
                                 ("France\nA country in Europe.\nIts capital is Paris.", 0.5)],
          "tallest mountain": [("Mount Everest\nEverest is 8849 m high.", 0.8)]}


def retrieve(body: Any) -> tuple[int, Any]:
    """Search-R1's `retrieval_server.py` `/retrieve`: a list of hits per query."""
    result = [[{"document": {"id": str(i), "contents": text}, "score": score}
               for i, (text, score) in enumerate(CORPUS.get(q, [])[: body["topk"]])] for q in body["queries"]]
    return 200, {"result": result}


def call(tool: Any, **parameters: Any) -> tuple[str, Any, Any]:
    async def go() -> tuple[str, Any, Any]:
        instance, _ = await tool.create()
        resp, reward, metrics = await tool.execute(instance, parameters)
        await tool.release(instance)
        return resp.text, reward, metrics
    return asyncio.run(go())


def load(tmp_path: Path, config: str, url: str) -> Any:
    path = tmp_path / "tools.yaml"
    path.write_text(config.format(url=url))
    (tool,) = load_tools(path)
    return tool


def test_verls_search_tool_file_loads_and_formats_the_passages_as_verl(tmp_path: Path, service: Any) -> None:
    server = service(retrieve)
    tool = load(tmp_path, VERL_SEARCH_TOOL_CONFIG, server.url + "/retrieve")
    assert isinstance(tool, SearchTool) and tool.name == "search"
    text, reward, metrics = call(tool, query_list=["capital of france", "tallest mountain"])
    assert server.received == [{"queries": ["capital of france", "tallest mountain"], "topk": 3,
                                "return_scores": True}]
    assert json.loads(text) == {"result": (
        "Doc 1 (Title: Paris)\nParis is the capital of France.\n\n"
        "Doc 2 (Title: France)\nA country in Europe.\nIts capital is Paris."
        "\n---\n"
        "Doc 1 (Title: Mount Everest)\nEverest is 8849 m high.")}
    assert reward == 0.0
    assert metrics == {"query_count": 2, "status": "success", "total_results": 3, "api_request_error": None}


def test_search_answers_as_verl_when_nothing_or_no_list_comes(tmp_path: Path, service: Any) -> None:
    server = service(lambda body: (200, {"result": []}))
    tool = load(tmp_path, VERL_SEARCH_TOOL_CONFIG, server.url)
    text, _, metrics = call(tool, query_list=["nothing"])
    assert json.loads(text) == {"result": "No search results found."} and metrics["status"] == "no_results"
    text, reward, metrics = call(tool, query_list="not a list")
    assert json.loads(text) == {"result": "Error: 'query_list' is missing, empty, or not a list in parameters."}
    assert (reward, metrics) == (0.0, {})
    assert len(server.received) == 1  # the bad call never reached the service


def test_search_retries_a_5xx_then_answers(tmp_path: Path, service: Any) -> None:
    answers = iter([(503, {"error": "busy"}), (200, {"result": [[{"document": {"contents": "T\nbody"}}]]})])
    server = service(lambda body: next(answers))
    response, error = asyncio.run(post_json(server.url, {"queries": ["q"]}, 5,
                                            RetryRule(attempts=3, statuses=(503,), on_connection_error=True,
                                                      delay=0.01)))
    assert error is None and response["result"][0][0]["document"]["contents"] == "T\nbody"
    assert len(server.received) == 2


def test_a_dead_search_service_is_tool_text_not_a_failed_step(tmp_path: Path, service: Any) -> None:
    server = service(retrieve)
    url = server.url
    server.close()  # nothing listens there now
    tool = load(tmp_path, VERL_SEARCH_TOOL_CONFIG, url)
    response, error = asyncio.run(post_json(url, {}, 1, RetryRule(attempts=2, statuses=(), on_connection_error=True,
                                                                  delay=0.01)))
    assert response is None and error.startswith("API Call Failed: Connection Error")
    text = SearchTool._answer(response, error)[0]
    assert json.loads(text)["result"].startswith("Search error: API Call Failed: Connection Error")
    assert tool.url == url


def test_search_needs_its_service_url(tmp_path: Path) -> None:
    with pytest.raises(AgentConfigError, match=r"`retrieval_service_url: None` must be the "
                                               r"retrieval service's URL"):
        load(tmp_path, VERL_SEARCH_TOOL_CONFIG, "")


def run_code(body: Any) -> tuple[int, Any]:
    """A SandboxFusion `run_code` endpoint for the cases below, keyed by the code."""
    finished = {"status": "Finished", "stdout": "4\n", "stderr": "", "return_code": 0, "execution_time": 0.01}
    replies = {"print(2 + 2)": {"status": "Success", "run_result": finished},
               "1/0": {"status": "Failed", "run_result": {
                   "status": "Finished", "stdout": "", "stderr": "ZeroDivisionError: division by zero\n",
                   "return_code": 1}},
               "while True: pass": {"status": "Failed", "run_result": {"status": "TimeLimitExceeded",
                                                                      "stdout": "", "stderr": ""}}}
    return 200, replies[body["code"]]


def test_verls_sandbox_fusion_file_calls_the_service_as_verl(tmp_path: Path, service: Any) -> None:
    server = service(run_code)
    tool = load(tmp_path, VERL_SANDBOX_FUSION_TOOL_CONFIG, server.url + "/run_code")
    assert isinstance(tool, SandboxFusionTool) and tool.name == "code_interpreter"
    assert call(tool, code="print(2 + 2)")[:2] == ("4\n", None)
    assert server.received[0] == {"compile_timeout": 30, "run_timeout": 30, "code": "print(2 + 2)",
                                  "stdin": None, "memory_limit_MB": 1024, "language": "python",
                                  "files": {}, "fetch_files": []}
    assert call(tool, code="1/0")[0] == "ZeroDivisionError: division by zero\n"  # finished, stderr kept
    assert call(tool, code="while True: pass", timeout=5)[0] == NOT_FINISHED
    assert server.received[-1]["run_timeout"] == 5  # the model's timeout, as verl passes it
    assert call(tool, code="x", language="cobol")[0] == NOT_FINISHED  # refused before any call
    assert len(server.received) == 3


def test_sandbox_fusion_local_runs_in_the_sandbox(tmp_path: Path) -> None:
    config = VERL_SANDBOX_FUSION_TOOL_CONFIG.replace("      type: native", f"      python: {sandbox_python()}\n"
                                                     "      type: native")
    tool = load(tmp_path, config, "local")
    text, reward, metrics = call(tool, code="import os\nprint(sum(range(5)))\nprint(os.getuid() != 0)")
    assert (text, reward) == ("10\nTrue\n", None)
    assert metrics["status"] == "finished" and metrics["sandbox_strict"] == 1.0
    assert call(tool, code="1/0")[0].endswith("ZeroDivisionError: division by zero\n")
    text, _, metrics = call(tool, code="while True:\n    pass", timeout=1)  # the model's 1 s, under 30
    assert text == NOT_FINISHED and metrics["timed_out"] == 1.0
    assert call(tool, code="x", language="cpp")[0].startswith("error: language `cpp` is not run here")


def test_sandbox_fusion_needs_a_url_or_local(tmp_path: Path) -> None:
    with pytest.raises(AgentConfigError, match=r"must be the SandboxFusion service's `run_code` URL, or "
                                               r"`local`"):
        load(tmp_path, VERL_SANDBOX_FUSION_TOOL_CONFIG, "")
