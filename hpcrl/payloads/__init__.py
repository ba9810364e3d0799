"""Payload kinds other than hpcrl's trainer, one module each (see DESIGN.md "Payload kinds"):
the overrides a kind needs, how a stop reaches it, where its checkpoints and metrics are."""
