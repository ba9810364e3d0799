"""Benchmark: blocking `dcp.save` against `dcp.async_save` on the CPU, one process.

    python -m bench.checkpoint_async [--width 2048] [--layers 6] [--rounds 3]

A stand-in model (`layers` square linear layers) with AdamW state is trained one step, saved,
then trained one step more. Per mode it prints the medians of: the training step alone, the time
the save holds the step that saves (the whole write when blocking; staging the copy when async),
the next training step (an async write competes with it for the cores), and when the save is
done. What decides is the first step plus the next one: async pays only if their sum shrinks.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch


def _model(width: int, layers: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Callable[[], None]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(64, width)

    def train_step() -> None:
        model(x).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()

    return model, optim, train_step


def _round(mode: str, model: torch.nn.Module, optim: torch.optim.Optimizer,
           train_step: Callable[[], None]) -> dict[str, float]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        train_step()
        alone = time.perf_counter() - start
        model_state, optim_state = get_state_dict(model, optim)
        state = {"model": model_state, "optim": optim_state}
        start = time.perf_counter()
        future = None
        if mode == "blocking":
            dcp.save(state, checkpoint_id=Path(out), no_dist=True)
        else:
            future = dcp.async_save(state, checkpoint_id=Path(out), no_dist=True)
        held = time.perf_counter() - start
        train_step()
        after = time.perf_counter() - start - held
        if future is not None:
            future.result()
        done = time.perf_counter() - start
    return {"step alone": alone, "save holds the step": held, "next step": after, "save done": done}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model, optim, train_step = _model(args.width, args.layers)
    train_step()
    params = sum(p.numel() for p in model.parameters())
    print(f"{params / 1e6:.1f} M parameters, {params * 12 / 2**20:.0f} MiB of model and Adam state, "
          f"{torch.get_num_threads()} threads")
    for mode in ("blocking", "async"):
        rounds = [_round(mode, model, optim, train_step) for _ in range(args.rounds)]
        medians = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
        print(f"{mode:8s} " + " | ".join(f"{k} {v:.2f} s" for k, v in medians.items()))


if __name__ == "__main__":
    main()
