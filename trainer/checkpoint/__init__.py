"""Checkpoints: the directory layout and completeness rule (:mod:`~trainer.checkpoint.layout`,
no torch, read by hpcrl on login nodes) and the writer and reader of full (gathered) states
(:mod:`~trainer.checkpoint.full_state`). Nothing is imported here, so that the launcher can
read the layout without torch."""
