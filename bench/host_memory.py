"""The host-memory terms of the memory plan (`trainer.memplan.host_terms`) against measured RSS
on the CPU.

    python -m bench.host_memory [--model tests/data/model_configs/Qwen2.5-0.5B] [--layers 4]

Each measurement runs in a fresh process (``MALLOC_MMAP_THRESHOLD_=65536``: freed tensors go
back to the system at once) and reads ``VmRSS`` from ``/proc/self/status``:

- ``baseline``: a worker process's imports (torch, transformers, Ray, the actor worker's module,
  and vLLM when it is installed in this interpreter), the plan's ``HOST_PROCESS`` without the
  CUDA/ROCm runtime's host side, which only a GPU shows;
- ``shards``: the model's fp32 parameters built from its `config.json` (random, ``--layers``
  decoder layers), against the plan's offloaded-shard term for one rank (the whole model);
- ``moments``: AdamW's two moments after one step, against the plan's moments before the
  power-of-two rounding (CPU tensors are not pinned; on a GPU the offload's
  ``to("cpu", non_blocking=True)`` allocates them pinned, rounded as the plan counts them).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

MIB = 2**20


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def measure(model: str, layers: int) -> dict[str, int]:
    """In this process: RSS after the imports, after the model, after AdamW's first step."""
    import importlib.util

    import ray  # noqa: F401
    import torch
    import transformers

    import trainer.workers.actor  # noqa: F401
    from trainer.memplan import ModelShape, read_model

    if importlib.util.find_spec("vllm"):
        import vllm  # noqa: F401
    out = {"baseline": rss()}
    shape = ModelShape(read_model(model).with_layers(layers))
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**{k: v for k, v in shape.config.items() if k != "model_type"},
                                               model_type=shape.config["model_type"])
    net = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    out["shards"] = rss() - out["baseline"]
    out["shards_estimate"] = sum(n * 4 for n in shape.tensors())
    out["params"] = sum(p.numel() for p in net.parameters())
    optim = torch.optim.AdamW(net.parameters(), lr=1e-6)
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    before = rss()
    optim.step()
    out["moments"] = rss() - before
    out["moments_estimate"] = 2 * sum(n * 4 for n in shape.tensors())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tests/data/model_configs/Qwen2.5-0.5B")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--python", default=sys.executable, help="interpreter to measure in (e.g. the vLLM one)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.model, args.layers)))
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([args.python, "-m", "bench.host_memory", "--child", "--model", args.model,
                           "--layers", str(args.layers)], env=env, capture_output=True, text=True, check=True)
    m = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"{args.python}: {m['params'] / 1e6:.1f}M parameters ({args.layers} layers of {args.model})")
    print(f"  process baseline (imports)  {m['baseline'] / MIB:8.0f} MiB")
    for term in ("shards", "moments"):
        est = m[f"{term}_estimate"]
        print(f"  {term:<8} measured {m[term] / MIB:8.1f} MiB  plan {est / MIB:8.1f} MiB  "
              f"ratio {m[term] / est:.3f}")


if __name__ == "__main__":
    main()
