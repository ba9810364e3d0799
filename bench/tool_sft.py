"""Benchmark helper: a short supervised warm start that shows SmolLM2 the calculator's call format.

    python -m bench.tool_sft --dir D [--examples 64] [--epochs 1] [--lr 2e-5]

SmolLM2-135M-Instruct was never trained on function calls, and its chat template does not render
`tools=`: given the tool's description, it calls the tool in 0 of 256 validation questions
(bench/README.md), so reinforcement learning has no tool call to reinforce. This writes
`--examples` worked transcripts from the *training* split of `bench.learning`'s tool rows, each
the conversation the `tool_agent` loop would hold when the model calls the calculator right:

    system (the tool's description) / user (question) / assistant <tool_call>{expression}</tool_call>
    / tool (the calculator's own answer) / assistant "The answer is N.\n#### N"

and fine-tunes the model on its assistant tokens only (the loss mask is the loop's
`response_mask`: the tokens each assistant turn adds to the rendered conversation). The
transcripts are rendered with the tokenizer's chat template, the one rendering the loop's turns
are checked against, so the warm start sees the token stream RL will sample in. It is kept
deliberately light (by default 64 examples, one pass): enough that the model sometimes calls the
tool, so that RL then has calls to reinforce; `bench.learning --model D/smollm2-tool-sft` starts
from the result. The 256 validation questions are never shown.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from pathlib import Path
from typing import Any

from bench.learning import DEFAULT_DIR, prepare
from trainer.agent.tools.calculator import evaluate, format_number

#: The expression each kind of `trainer.rewards.arith` question asks for, from its numbers in order.
EXPRESSIONS = {"add": "{0} + {1}", "sub": "{0} - {1}", "mul": "{0} * {1}", "two_step": "{0} + {1} - {2}"}


def transcript(row: dict[str, Any]) -> list[dict[str, str]]:
    """The conversation of a right answer through the calculator, for a tool row."""
    info = row["extra_info"]
    numbers = re.findall(r"\d+", info["question"])
    expression = EXPRESSIONS[info["kind"]].format(*numbers)
    value = format_number(evaluate(expression))
    if value != row["reward_model"]["ground_truth"]:
        raise ValueError(f"row {info['index']}: {expression} = {value}, not the ground truth "
                         f"{row['reward_model']['ground_truth']}")
    call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    return [*row["prompt"],
            {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
            {"role": "tool", "content": value},
            {"role": "assistant", "content": f"The answer is {value}.\n#### {value}"}]


def tokens_and_mask(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """The whole conversation's tokens and a mask that is 1 on what each assistant turn adds
    (its content and end-of-turn token, not the template's newline after it)."""
    def render(msgs: list[dict[str, str]], prompt: bool) -> list[int]:
        return list(tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=prompt,
                                                  return_dict=False))
    ids = render(messages, False)
    mask = [0] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prefix = render(messages[: i + 1], False)
        start, end = len(render(messages[:i], True)), len(prefix)
        if ids[:end] != prefix:
            raise ValueError("the chat template does not render a conversation as its prefixes' "
                             "concatenation; the mask would be wrong")
        while end > start and tokenizer.decode(ids[end - 1 : end]).strip() == "":
            end -= 1  # the newline the template writes after the end-of-turn token
        mask[start:end] = [1] * (end - start)
    return ids, mask


def first_turns(model: Any, tokenizer: Any, root: Path, count: int) -> None:
    """A quick look, not the benchmark: the greedy first turn on the first `count` validation
    questions, read by the loop's hermes parser (calls, malformed calls) and decoded."""
    import torch

    from trainer.agent.parser import get_tool_parser
    from trainer.data import read_rows

    parser = get_tool_parser("hermes", tokenizer)
    rows = read_rows([root / "data-tools" / "test.parquet"])[:count]
    model.eval()
    tokenizer.padding_side = "left"
    calls = malformed = 0
    for b in range(0, len(rows), 8):
        prompts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
                   for r in rows[b : b + 8]]
        enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            gen = model.generate(**enc, max_new_tokens=48, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
        for i, seq in enumerate(gen[:, enc["input_ids"].shape[1]:].tolist()):
            parsed = parser.parse(seq)
            calls += bool(parsed.calls)
            malformed += parsed.malformed
            if b + i < 2:
                print(f"  validation question {b + i}: {tokenizer.decode(seq, skip_special_tokens=True)!r}")
    print(f"greedy first turns on {len(rows)} validation questions: {calls} call the tool, "
          f"{malformed} malformed call blocks")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.tool_sft", description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="bench.learning's work directory")
    p.add_argument("--examples", type=int, default=64, help="training transcripts")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--look", type=int, default=32, help="validation questions for the last look")
    p.add_argument("--out", type=Path, help="output model directory (default DIR/smollm2-tool-sft)")
    args = p.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.data import read_rows

    model_dir, _ = prepare(args.dir)
    out = args.out or args.dir / "smollm2-tool-sft"
    if out.exists():
        raise SystemExit(f"bench.tool_sft: {out} exists; move it away (or pass --out)")
    rows = read_rows([args.dir / "data-tools" / "train.parquet"])[: args.examples]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    examples = [tokens_and_mask(tokenizer, transcript(r)) for r in rows]
    print(f"{len(examples)} transcripts, {sum(len(t) for t, _ in examples)} tokens, "
          f"{sum(sum(m) for _, m in examples)} of them trained; the first:\n"
          + tokenizer.decode(examples[0][0]), flush=True)

    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    rng = random.Random(args.seed)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    t0, step = time.monotonic(), 0
    for epoch in range(args.epochs):
        order = list(range(len(examples)))
        rng.shuffle(order)
        for b in range(0, len(order), args.batch):
            batch = [examples[i] for i in order[b : b + args.batch]]
            width = max(len(t) for t, _ in batch)
            ids = torch.tensor([t + [pad] * (width - len(t)) for t, _ in batch])
            attn = torch.tensor([[1] * len(t) + [0] * (width - len(t)) for t, _ in batch])
            labels = torch.tensor([[x if m else -100 for x, m in zip(t, mk, strict=True)]
                                   + [-100] * (width - len(t)) for t, mk in batch])
            loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            print(f"epoch {epoch} step {step}: loss {loss.item():.4f} ({time.monotonic() - t0:.0f} s)",
                  flush=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"saved {out} after {step} steps, {time.monotonic() - t0:.0f} s", flush=True)
    first_turns(model, tokenizer, args.dir, args.look)
    return 0


if __name__ == "__main__":
    sys.exit(main())
