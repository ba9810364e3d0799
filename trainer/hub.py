"""Model ids as verl's users write them (`actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct`),
resolved through the Hugging Face cache as transformers and vLLM do, with no torch and no
network here (hpcrl's preflight reads it on a login node).

The cache is huggingface_hub's: `HF_HUB_CACHE`, else `HF_HOME/hub`, else
`XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub`; a model lives in
`models--<org>--<name>/`, its files in `snapshots/<commit>/`, and `refs/<revision>` names the
commit of a branch or tag (`main`). Compute nodes often have no internet: the cache is filled
beforehand on a machine that has (`hf download <id>`) on a file system the nodes share, and the
nodes read it offline. :func:`resolve_hub_model` finds the snapshot; only where the hub is
reachable (`HF_HUB_OFFLINE` not set) does the trainer download what is missing
(:func:`trainer.models.resolve_model_path`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

__all__ = ["HubModelError", "hub_cache", "is_hub_id", "is_offline", "missing_message",
           "resolve_hub_model"]

_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


class HubModelError(FileNotFoundError):
    """A hub model id that is neither in the cache nor downloadable here."""


def is_hub_id(value: str | Path) -> bool:
    """`org/name` (a hub repository id) that is not an existing local path."""
    text = str(value)
    return bool(_ID.match(text)) and not Path(text).expanduser().exists()


def hub_cache(environ: Mapping[str, str] | None = None) -> Path:
    """The hub cache directory huggingface_hub uses under `environ` (`os.environ`)."""
    env = os.environ if environ is None else environ
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    xdg = env.get("XDG_CACHE_HOME") or str(Path(env.get("HOME") or "~").expanduser() / ".cache")
    return Path(xdg).expanduser() / "huggingface" / "hub"


def is_offline(environ: Mapping[str, str] | None = None) -> bool:
    """`HF_HUB_OFFLINE` (or transformers' `TRANSFORMERS_OFFLINE`) is on."""
    env = os.environ if environ is None else environ
    return any(env.get(n, "").strip().lower() in ("1", "true", "yes", "on")
               for n in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def resolve_hub_model(repo_id: str, environ: Mapping[str, str] | None = None,
                      revision: str = "main") -> Path | None:
    """The cached snapshot directory of `repo_id` at `revision` (a branch or tag through
    `refs/`, or a commit), or None when the cache does not hold it (with its `config.json`)."""
    folder = hub_cache(environ) / ("models--" + repo_id.replace("/", "--"))
    ref = folder / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision if _COMMIT.match(revision) else None
    if commit is None:
        return None
    snapshot = folder / "snapshots" / commit
    return snapshot if (snapshot / "config.json").is_file() else None


def missing_message(key: str, repo_id: str, environ: Mapping[str, str] | None = None,
                    why: str = "") -> str:
    """What to do about a hub id the cache lacks (`why`: why it cannot be downloaded here)."""
    env = os.environ if environ is None else environ
    cache = hub_cache(env)
    home = env.get("HF_HOME")
    where = f"`HF_HOME={home}`" if home else "`HF_HOME` unset"
    return (f"`{key}={repo_id}` is a Hugging Face hub id, and the cache `{cache}` ({where}) does "
            f"not hold it{why}. Fix: fill the cache beforehand on a machine with internet, "
            f"`HF_HOME={home or '<dir the nodes share>'} hf download {repo_id}` (or "
            "`huggingface-cli download`), and set the same `HF_HOME` in the site profile's `env`; "
            "or pass a local directory written by `save_pretrained`")
