"""verl's agent loops: a rollout where each trajectory is a loop of its own (a single turn, or
turns of generation and tool calls), run concurrently against token-in/token-out servers.

- :mod:`trainer.agent.base`: the seams (:class:`TokenServer`, :class:`AgentLoop`,
  :class:`AgentOutput`, :class:`Tool`, :class:`Interaction`).
- :mod:`trainer.agent.tools`: verl's tool config file and the tools shipped here.
- :mod:`trainer.agent.parser`: tool calls in the model's text (verl's `hermes` format).
- :mod:`trainer.agent.loops`: `single_turn_agent` and `tool_agent`, by verl's names.
- :mod:`trainer.agent.verl_compat`: loops written against verl's interface, run unchanged.
"""
