"""What a seed per request costs vLLM's sampler: the same batch sampled with one unseeded
`SamplingParams` (what the engine sends, as verl) and with a seed per row (what it sent before).

    .venv-vllm/bin/python -m bench.vllm_seeds [--rows 256] [--tokens 32] [--layers 2] [--repeats 3]

vLLM (V1) samples the rows of a batch without a seed in one call on its generator; a seeded row
gets a `torch.Generator` of its own and is sampled apart from the rest (`vllm/v1/sample/ops/
topk_topp_sampler.py`, `random_sample`: one `exponential_` per seeded request). The model is
Qwen2.5-0.5B's shape cut to `--layers` decoder layers with random weights (`load_format=dummy`,
no tokenizer), on whatever vLLM runs on here (the CPU backend without a GPU). Prints the time of
each run and the tokens per second of each variant (the best of `--repeats`)."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

CONFIG = Path(__file__).resolve().parents[1] / "tests" / "data" / "model_configs" / "Qwen2.5-0.5B" / "config.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    for key, value in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "2",
                       "VLLM_CPU_OMP_THREADS_BIND": "nobind", "TORCHDYNAMO_DISABLE": "1",
                       "VLLM_NO_USAGE_STATS": "1"}.items():
        os.environ.setdefault(key, value)
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with tempfile.TemporaryDirectory() as model:
        config = json.loads(CONFIG.read_text())
        config["num_hidden_layers"] = args.layers
        (Path(model) / "config.json").write_text(json.dumps(config))
        gpu = torch.cuda.is_available()
        llm = LLM(model=model, skip_tokenizer_init=True, load_format="dummy", dtype="bfloat16" if gpu else "float32",
                  max_model_len=256, enforce_eager=not gpu, seed=0, max_num_seqs=args.rows,
                  gpu_memory_utilization=0.5)
        gen = torch.Generator().manual_seed(0)
        prompts = [TokensPrompt(prompt_token_ids=torch.randint(100, 20000, (16,), generator=gen).tolist())
                   for _ in range(args.rows)]

        def params(seed: int | None) -> SamplingParams:
            return SamplingParams(n=1, temperature=1.0, max_tokens=args.tokens, min_tokens=args.tokens,
                                  detokenize=False, seed=seed)

        variants = {"one unseeded SamplingParams": lambda: params(None),
                    "a seed per row": lambda: [params(s) for s in range(args.rows)]}
        best: dict[str, float] = {}
        llm.generate(prompts[:8], params(None), use_tqdm=False)  # warm-up
        for _ in range(args.repeats):
            for name, make in variants.items():
                start = time.perf_counter()
                outs = llm.generate(prompts, make(), use_tqdm=False)
                took = time.perf_counter() - start
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                print(f"{name:<28} {took:7.2f} s  {tokens} tokens", flush=True)
                best[name] = max(best.get(name, 0.0), tokens / took)
        device = torch.cuda.get_device_name() if gpu else "CPU"
        print(f"\n{args.rows} rows x {args.tokens} tokens, {args.layers} layers of Qwen2.5-0.5B, {device}:")
        for name, rate in best.items():
            print(f"  {name:<28} {rate:9.1f} tokens/s")
        base = best["one unseeded SamplingParams"]
        print(f"  per-row seeds: {100 * (1 - best['a seed per row'] / base):.1f}% fewer tokens/s")


if __name__ == "__main__":
    main()
