"""verl 0.9.1's side of `test_reward_inputs_vs_verl.py`: run with the interpreter where verl is
installed (`.venv-verl`), it reads finished trajectories as JSON on standard input and prints,
as JSON, the token-level rewards verl's own code gives them.

The path is verl's, function by function: each trajectory becomes an `AgentLoopOutput` and goes
through `AgentLoopWorker._agent_loop_postprocess` (padding, `raw_prompt` into `extra_fields`,
`_compute_score`: the reward loop is asked only when the loop set no `reward_score`), then
`AgentLoopWorker._postprocess` (`rm_scores`) and `extract_reward`. The reward is computed by a
real `RewardLoopWorker` (its `naive` reward manager, `run_single`) with the custom reward
function of the input. One seam is replaced: the Ray actor call (`handle.compute_score.remote`)
runs the worker's method in this process, on a pickled copy of the data as Ray would send it.
The worker is built without its `__init__` (which starts servers and tools); it gets the few
attributes these methods read. Nothing of hpcrl is imported here.

Input: {"tokenizer_dir", "reward_path", "reward_name", "prompt_length", "response_length",
"rows": [{"prompt_ids", "response_ids", "response_mask", "num_turns", "extra_fields",
"reward_score", "kwargs": {the row's non-tensor fields: data_source, reward_model, extra_info,
raw_prompt, ...}}]}. Output: {"token_scores": [[...], ...], "reward_extra_keys": [...]}.
"""

from __future__ import annotations

import asyncio
import json
import pickle
import sys
from types import SimpleNamespace
from typing import Any


class _LocalCall:
    """`handle.compute_score` with `.remote(data)`: the worker's coroutine, on a copy of `data`."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    def remote(self, data: Any) -> Any:
        return asyncio.ensure_future(self.worker.compute_score(pickle.loads(pickle.dumps(data))))


async def main(spec: dict[str, Any]) -> dict[str, Any]:
    from omegaconf import OmegaConf
    from verl.experimental.agent_loop.agent_loop import (
        AgentLoopMetrics,
        AgentLoopOutput,
        AgentLoopWorker,
    )
    from verl.experimental.reward_loop.reward_loop import RewardLoopWorker
    from verl.trainer.ppo.reward import extract_reward
    from verl.utils import hf_tokenizer

    config = OmegaConf.create({
        "actor_rollout_ref": {"model": {"path": spec["tokenizer_dir"], "tokenizer_path": spec["tokenizer_dir"]}},
        "reward": {
            "reward_model": {"enable": False},
            "custom_reward_function": {"path": spec["reward_path"], "name": spec["reward_name"], "reward_kwargs": {}},
            "reward_manager": {"source": "register", "name": "naive", "module": {"path": None, "name": None}},
        },
    })
    reward_worker = RewardLoopWorker(config)  # built inside the event loop: its manager keeps this loop
    worker = AgentLoopWorker.__new__(AgentLoopWorker)
    worker.rollout_config = SimpleNamespace(prompt_length=spec["prompt_length"],
                                            response_length=spec["response_length"])
    worker.tokenizer = hf_tokenizer(spec["tokenizer_dir"])
    worker.processor = None
    worker.hf_model_type = None
    worker.mm_processor_kwargs = {}
    worker.distillation_enabled = False
    worker.reward_loop_worker_handles = [SimpleNamespace(compute_score=_LocalCall(reward_worker))]

    padded = []
    for row in spec["rows"]:  # one at a time: the reward function's calls keep the rows' order
        output = AgentLoopOutput(
            prompt_ids=row["prompt_ids"], response_ids=row["response_ids"], response_mask=row["response_mask"],
            num_turns=row["num_turns"], extra_fields=dict(row["extra_fields"]), reward_score=row["reward_score"],
            metrics=AgentLoopMetrics())
        padded.append(await worker._agent_loop_postprocess(output, False, **row["kwargs"]))
    batch = worker._postprocess(padded, input_non_tensor_batch=None, validate=False)
    reward_tensor, extra_infos = extract_reward(batch)
    return {"token_scores": reward_tensor.tolist(), "reward_extra_keys": sorted(extra_infos)}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(json.load(sys.stdin)))))
