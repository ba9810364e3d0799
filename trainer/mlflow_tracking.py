"""MLflow, as verl uses it: the metrics logger (`trainer.logger=[..., mlflow]`) and the agent
loops' traces (`actor_rollout_ref.rollout.trace.backend=mlflow`), both in one tracking store.

The store is `MLFLOW_TRACKING_URI` when set (a tracking server, a shared database), else a
SQLite file in the run directory, `<run_dir>/mlruns.db` (`mlflow ui --backend-store-uri
sqlite:///<run_dir>/mlruns.db` shows it), its artifacts (the traces among them) in
`<run_dir>/mlartifacts`. verl's default is `/tmp/mlruns.db`: on a cluster that is the node's own
disk, which a requeued job, started on another node, would not find again.

The MLflow experiment is `trainer.project_name` and the run `trainer.experiment_name`, as in
verl. The run's id is kept in `<run_dir>/mlflow_run_id`, so a requeued or resumed job logs into
the same MLflow run (`MLFLOW_RUN_ID`, as in verl, names one to attach to instead). Steps a resumed
run does again (those after its checkpoint) get a second value at the same step: MLflow keeps
every value, in the order logged.

`mlflow` is imported only where used. `mlflow-skinny` with `sqlalchemy` and `alembic` (the
SQLite store) is enough; the full `mlflow` package works too.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
RUN_ID_FILE = "mlflow_run_id"
INSTALL = "`pip install mlflow-skinny sqlalchemy alembic` (or `mlflow`)"
PARAM_VALUE_MAX = 6000
"""MLflow's longest parameter value (characters); longer ones are cut, ending in `...`."""

_INVALID = re.compile(r"[^/\w.\- :]")
_SLASHES = re.compile(r"/+")


class MlflowUnavailable(RuntimeError):
    """MLflow was asked for and cannot be imported; the message names the fix."""


def import_mlflow(what: str) -> Any:
    """`mlflow`, or an error naming `what` asked for it and how to install it."""
    try:
        import mlflow
    except ImportError as err:
        raise MlflowUnavailable(f"{what} needs the `mlflow` package, which cannot be imported "
                                f"({err}); {INSTALL} where the trainer runs, or remove it") from None
    return mlflow


def tracking_uri(run_dir: str | Path) -> str:
    """`MLFLOW_TRACKING_URI`, else a SQLite store in the run directory."""
    return os.environ.get(TRACKING_URI_ENV) or f"sqlite:///{Path(run_dir).resolve() / 'mlruns.db'}"


def artifact_root(uri: str) -> str | None:
    """Where a new experiment of a SQLite store keeps its artifacts (traces are artifacts): the
    `mlartifacts` folder beside the database; None (the store's own choice) for other stores.
    MLflow's default for a SQLite store is `./mlruns`, the working directory of whichever
    process creates the experiment."""
    if not uri.startswith("sqlite:///"):
        return None
    return (Path(uri.removeprefix("sqlite:///")).parent / "mlartifacts").resolve().as_uri()


def connect(what: str, uri: str | None, project: str) -> Any:
    """`mlflow`, pointed at the store `uri` (None: MLflow's own choice), with `project` as the
    active experiment (made, with its artifacts beside a SQLite database, when it does not exist
    yet)."""
    mlflow = import_mlflow(what)
    if uri:
        mlflow.set_tracking_uri(uri)
    if mlflow.get_experiment_by_name(project) is None:
        try:
            mlflow.create_experiment(project, artifact_location=artifact_root(mlflow.get_tracking_uri()))
        except mlflow.exceptions.MlflowException:
            if mlflow.get_experiment_by_name(project) is None:  # not another rank's creation
                raise
    mlflow.set_experiment(project)
    return mlflow


def metric_key(key: str) -> str:
    """A metric name MLflow accepts, as verl writes it: `@` -> `_at_`, one slash at a time, any
    other character MLflow refuses -> `_` (`val-core/x/acc/mean@1` -> `val-core/x/acc/mean_at_1`)."""
    return _INVALID.sub("_", _SLASHES.sub("/", key.replace("@", "_at_")))


def flat_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """The config as MLflow parameters: nested keys joined by `/` (as verl's), list items by
    their index, values as text of at most `PARAM_VALUE_MAX` characters."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flat_params(value, f"{name}/"))
        elif isinstance(value, list | tuple) and value and all(isinstance(v, Mapping) for v in value):
            for i, item in enumerate(value):
                out.update(flat_params(item, f"{name}/{i}/"))
        else:
            text = str(value)
            out[metric_key(name)] = text if len(text) <= PARAM_VALUE_MAX else text[: PARAM_VALUE_MAX - 3] + "..."
    return out


class MlflowRun:
    """The training run's MLflow run: opened (or reopened) at start, a step's numbers per `log`."""

    def __init__(self, run_dir: str | Path, project: str, experiment: str, config: Mapping[str, Any]) -> None:
        self.mlflow = connect("`trainer.logger` with `mlflow`", tracking_uri(run_dir), project)
        id_file = Path(run_dir) / RUN_ID_FILE
        run_id = os.environ.get("MLFLOW_RUN_ID") or (id_file.read_text().strip() if id_file.exists() else None)
        if run_id:
            self.mlflow.start_run(run_id=run_id)
        else:
            run = self.mlflow.start_run(run_name=experiment)
            id_file.write_text(run.info.run_id)
            params = flat_params(config)
            names = sorted(params)
            for i in range(0, len(names), 100):  # MLflow takes at most 100 parameters per call
                self.mlflow.log_params({k: params[k] for k in names[i : i + 100]})
        self.run_id = self.mlflow.active_run().info.run_id

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        numbers = {metric_key(k): float(v) for k, v in metrics.items()
                   if isinstance(v, int | float) and not isinstance(v, bool)}
        if numbers:
            self.mlflow.log_metrics(numbers, step=step)

    def close(self) -> None:
        self.mlflow.end_run()
