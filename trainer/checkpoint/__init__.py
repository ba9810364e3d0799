"""Checkpoints: the directory layout and completeness rule (:mod:`~trainer.checkpoint.layout`,
no torch, read by hpcrl on login nodes), the directory's writer and reader with its small named
states (:mod:`~trainer.checkpoint.full_state`) and the sharded model and optimizer states of the
worker groups (:mod:`~trainer.checkpoint.sharded`, torch.distributed.checkpoint). Nothing is imported here, so that the launcher can
read the layout without torch."""
