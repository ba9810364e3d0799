"""verl's `SearchTool` (`verl/tools/search_tool.py`, `verl/tools/utils/search_r1_like_utils.py`,
verl `b178a3cd`), the Search-R1 tool: the model sends `query_list`, the tool asks a retrieval
service (Search-R1's `retrieval_server.py` API: POST `{"queries", "topk", "return_scores"}`,
answer `{"result": [[{"document": {"contents": "Title\\ntext"}, "score": s}, ...], ...]}`) and
answers with the passages, formatted as verl formats them."""

from __future__ import annotations

import json
from typing import Any
from uuid import uuid4

from trainer.agent.base import CallGate, Tool, ToolResponse
from trainer.agent.tools.http_service import RetryRule, post_json
from trainer.agent.tools.loading import AgentConfigError, check_config_keys

__all__ = ["SEARCH_RETRY", "SearchTool", "format_passages"]

KEYS = {"retrieval_service_url": None, "topk": 3, "timeout": 30, "num_workers": 120,
        "rate_limit": 120, "enable_global_rate_limit": True}
"""verl's config keys and defaults (`SearchTool.__init__`)."""
SEARCH_RETRY = RetryRule(attempts=10, statuses=(500, 502, 503, 504), on_connection_error=True)
"""`call_search_api`: 10 tries on a 5xx, a refused connection or a timeout, 1, 2, ... s apart."""


def format_passages(retrieval: list[dict[str, Any]]) -> str:
    """verl's `_passages2string`: `Doc i (Title: first line)` then the rest of the contents."""
    text = ""
    for i, item in enumerate(retrieval):
        content = item["document"]["contents"]
        title = content.split("\n")[0]
        body = "\n".join(content.split("\n")[1:])
        text += f"Doc {i + 1} (Title: {title})\n{body}\n\n"
    return text.strip()


def _result(text: str) -> str:
    return json.dumps({"result": text}, ensure_ascii=False)


class SearchTool(Tool):
    """Port of verl's `verl.tools.search_tool.SearchTool`, the same texts and metrics
    (`perform_single_search_batch`). verl bounds concurrent searches across the whole Ray cluster
    with one named actor (`rate_limit`); here each rollout process holds at most
    `min(num_workers, rate_limit)` searches at once (with `enable_global_rate_limit: false`,
    `num_workers`)."""

    def __init__(self, config: dict[str, Any], tool_schema: dict[str, Any]) -> None:
        check_config_keys("`SearchTool`", config, KEYS)
        super().__init__(config, tool_schema)
        values = {**KEYS, **{k: v for k, v in config.items() if k in KEYS and v is not None}}
        self.url = values["retrieval_service_url"]
        if not isinstance(self.url, str) or not self.url.startswith(("http://", "https://")):
            raise AgentConfigError(f"`SearchTool` config: `retrieval_service_url: {self.url!r}` must be "
                                   "the retrieval service's URL (Search-R1's `retrieval_server.py` "
                                   "serves `http://HOST:8000/retrieve`)")
        self.topk, self.timeout = int(values["topk"]), float(values["timeout"])
        slots = int(values["num_workers"])
        if values["enable_global_rate_limit"]:
            slots = min(slots, int(values["rate_limit"]))
        self.slots = max(1, slots)
        self._gate = CallGate(self.slots)
        self._instances: dict[str, list[str]] = {}

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        instance_id = instance_id or str(uuid4())
        self._instances[instance_id] = []
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
                      ) -> tuple[ToolResponse, float, dict[str, Any]]:
        queries = parameters.get("query_list")
        if not queries or not isinstance(queries, list):
            return ToolResponse(text=_result("Error: 'query_list' is missing, empty, or not a list "
                                             "in parameters.")), 0.0, {}
        async with self._gate():
            response, error = await post_json(
                self.url, {"queries": queries, "topk": self.topk, "return_scores": True},
                self.timeout, SEARCH_RETRY)
        text, status, total = self._answer(response, error)
        self._instances.setdefault(instance_id, []).append(text.strip())
        return ToolResponse(text=text), 0.0, {"query_count": len(queries), "status": status,
                                              "total_results": total, "api_request_error": error}

    @staticmethod
    def _answer(response: Any, error: str | None) -> tuple[str, str, int]:
        """(text, status, total results) as `perform_single_search_batch` gives them."""
        if error:
            return _result(f"Search error: {error}"), "api_error", 0
        if not response:
            return _result("Unknown API state (no response and no error message)."), "unknown_api_state", 0
        try:
            raw = response.get("result", [])
            if not raw:
                return _result("No search results found."), "no_results", 0
            total = sum(len(r) if isinstance(r, list) else 1 for r in raw)
            return _result("\n---\n".join(format_passages(r) for r in raw)), "success", total
        except Exception as e:  # noqa: BLE001 - verl's "processing_error": a malformed answer is tool text
            return _result(f"Error processing search results: {e}"), "processing_error", 0

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> Any:
        return self._instances[instance_id]

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self._instances.pop(instance_id, None)
