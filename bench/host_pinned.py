"""On a GPU: the pinned host memory of the optimizer offload (and of vLLM's level-1 sleep) against
the memory plan's terms (`trainer.memplan.host_terms`: every block rounded up to a power of two).

    python -m bench.host_pinned [--model tests/data/model_configs/Qwen2.5-7B-Instruct] [--world 16]

- ``moments``: one rank's AdamW moments of `--model` sharded over `--world` ranks (fp32, FSDP2's
  dim-0 shards), made on the GPU and offloaded as `trainer.phases.move_optimizer` does
  (`to("cpu", non_blocking=True)`); measured: torch's host allocator statistics
  (`torch.cuda.host_memory_stats()`, when this torch has it) and the process's RSS growth.
- ``process``: the RSS of this process before and after the CUDA/ROCm context starts.
- ``vllm``: with `--vllm` and vLLM installed, an engine of `--vllm-model`'s shape (random weights)
  at level-1 sleep (RSS growth: the pinned backup) and at level 2.
Needs a GPU; prints one line per figure.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from trainer.memplan import GIB, ModelShape, pinned, read_model

CONFIGS = Path(__file__).resolve().parents[1] / "tests" / "data" / "model_configs"


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def moments(shape: ModelShape, world: int) -> None:
    import torch

    before = rss()
    torch.cuda.init()
    torch.ones(1, device="cuda")
    print(f"process: RSS {before / GIB:.2f} GiB before CUDA, {rss() / GIB:.2f} GiB after "
          f"({torch.cuda.get_device_name()})")
    shards = [-(-n // world) for n in shape.tensors()]
    state = [torch.zeros(n, device="cuda") for n in shards for _ in range(2)]
    start = rss()
    host = [t.to("cpu", non_blocking=True) for t in state]
    torch.cuda.synchronize()
    grown = rss() - start
    exact = sum(t.numel() * 4 for t in state)
    plan = 2 * sum(pinned(n * 4) for n in shards)
    stats = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
    held = {k: v for k, v in stats.items() if "reserved" in k or "allocated" in k}
    print(f"moments: {len(host)} tensors, exact {exact / GIB:.2f} GiB, plan (rounded) {plan / GIB:.2f} GiB, "
          f"RSS growth {grown / GIB:.2f} GiB")
    print(f"host allocator stats: {json.dumps({k: round(v / GIB, 3) for k, v in held.items()})}")
    del host, state


def vllm_sleep(shape_path: str) -> None:
    import torch
    from vllm import LLM

    shape = read_model(shape_path)
    with tempfile.TemporaryDirectory() as model:
        config = dict(shape.config)
        (Path(model) / "config.json").write_text(json.dumps(config))
        llm = LLM(model=model, skip_tokenizer_init=True, load_format="dummy", dtype="bfloat16",
                  max_model_len=512, enable_sleep_mode=True, gpu_memory_utilization=0.3, enforce_eager=True)
        plan = sum(pinned(n * 2) for n in shape.tensors(fused=True))
        for level in (1, 2):
            start = rss()
            llm.sleep(level=level)
            torch.cuda.synchronize()
            print(f"vllm level-{level} sleep: RSS growth {(rss() - start) / GIB:.2f} GiB "
                  f"(plan for level 1: {plan / GIB:.2f} GiB, exact bf16 weights {shape.params() * 2 / GIB:.2f} GiB)")
            llm.wake_up()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(CONFIGS / "Qwen2.5-7B-Instruct"))
    parser.add_argument("--world", type=int, default=16)
    parser.add_argument("--vllm", action="store_true")
    parser.add_argument("--vllm-model", default=str(CONFIGS / "Qwen2.5-0.5B"))
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    moments(read_model(args.model), args.world)
    if args.vllm:
        vllm_sleep(args.vllm_model)


if __name__ == "__main__":
    main()
