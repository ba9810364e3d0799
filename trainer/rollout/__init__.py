"""Rollout engines behind one interface (:mod:`trainer.rollout.base`): HF `generate`
(:mod:`trainer.rollout.hf`, CPU and tests) and vLLM (:mod:`trainer.rollout.vllm`, GPUs), both
also taking token lists one response each (`generate_tokens`, the agent loops' batched turns);
and the server-mode vLLM replica (:mod:`trainer.rollout.vllm_server`), one turn per request."""
