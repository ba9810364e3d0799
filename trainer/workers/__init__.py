"""Worker classes (one rank each: :mod:`~trainer.workers.actor`, :mod:`~trainer.workers.critic`)
and the worker-group interface with its two backends (:mod:`~trainer.workers.group`: in this
process; :mod:`~trainer.workers.ray_group`: Ray actors across nodes)."""
