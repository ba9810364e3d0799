"""Packed sequences (`use_remove_padding`) under each attention the workers could run: transformers'
`sdpa` (a dense (T, T) block-diagonal mask), `trainer.models.PACKED_SDPA` (SDPA once per sequence,
no mask) and, where flash-attn is installed, `flash_attention_2` (varlen).

    python -m bench.packed_attention [--seqs 16] [--length 1024] [--layers 2]

A random model of Qwen2.5-0.5B's shape cut to `--layers` layers, bf16 on the GPU (fp32 on the
CPU), one forward and backward of the log-prob path (`trainer.models.compute_log_probs`,
`remove_padding=True`) over `--seqs` sequences of `--length` tokens; prints the time (best of 3),
the peak device memory and the largest log-prob difference from `PACKED_SDPA`.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path

import torch

from trainer import models as M
from trainer.memplan import read_model

CONFIG = Path(__file__).resolve().parents[1] / "tests" / "data" / "model_configs" / "Qwen2.5-0.5B"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM

    gpu = torch.cuda.is_available()
    device, dtype = (torch.device("cuda"), torch.bfloat16) if gpu else (torch.device("cpu"), torch.float32)
    packed = M.attention_implementation(torch.device("cpu"), dtype)  # registers PACKED_SDPA
    impls = ["sdpa", packed] + (["flash_attention_2"] if gpu and importlib.util.find_spec("flash_attn") else [])
    cfg = read_model(str(CONFIG)).with_layers(args.layers)
    torch.manual_seed(0)
    ids = torch.randint(100, 20000, (args.seqs, args.length), device=device)
    mask = torch.ones_like(ids)
    reference = None
    for impl in impls:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), dtype=dtype,
                                                 attn_implementation=impl).to(device)
        best, peak = float("inf"), 0
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            if gpu:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            lp, _ = M.compute_log_probs(model, ids, mask, args.length // 2, remove_padding=True)
            lp.float().sum().backward()
            if gpu:
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated()
            best = min(best, time.perf_counter() - start)
        lp = lp.detach().float()
        diff = 0.0 if reference is None else float((lp - reference).abs().max())
        if impl == packed:
            reference = lp
        print(f"{impl:<20} {best * 1000:8.1f} ms  peak {peak / 2**30:6.2f} GiB  max |dlogp| vs packed sdpa "
              f"{diff if impl != 'sdpa' else float('nan'):.2e}")
        del model
    print(f"{args.seqs} x {args.length} tokens packed, {args.layers} layers of Qwen2.5-0.5B, "
          f"{torch.cuda.get_device_name() if gpu else 'CPU'}, {dtype}")


if __name__ == "__main__":
    main()
