"""The node agent: one per node of a job, bringing up Ray and running the payload.

Run as `python -m hpcrl.agent RUN_DIR`. Importing this package imports no Ray.
"""
