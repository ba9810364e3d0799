"""A tiny random Llama model and a word-level tokenizer, built locally without any hub.

Used by the tests and benchmarks: the toy tasks (copy a digit, say sevens, GSM8K-format
answers after ``####``) need only the words in :data:`WORDS`. Hidden size 128 with 4 heads
gives head_dim 32, which vLLM's CPU attention backend accepts.

``python -m trainer.tiny OUTDIR`` writes a directory that ``AutoModelForCausalLM`` and
``AutoTokenizer`` load with ``from_pretrained``.

``tools=True`` (``--tools``) gives the tools variant for the agent loops: the same ids for every
token above, new tokens appended after them (a ``tool`` role, ``<tool_call>``/``</tool_call>``,
JSON punctuation, spaces and newlines, the words of tool schemas), whitespace kept as tokens so
that decoding gives the text back (the hermes parser JSON-decodes it), and a ChatML-like chat
template that renders ``tools`` and separates turns with ``\n`` after ``</s>`` (the separator a
model does not generate, as ChatML's ``\n`` after ``<|im_end|>``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<s>", "</s>"
ROLES = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD, UNK, BOS, EOS, *ROLES)
DIGITS = tuple(str(d) for d in range(10))
PUNCTUATION = ("####", "+", "-", "=", "?", ".", ",", ":", "$")
WORDS = (
    "copy", "say", "sevens", "seven", "the", "digit", "answer", "is", "what", "a", "and",
    "of", "number", "please", "then", "after", "write", "repeat", "sum", "plus", "minus",
    "equals", "question", "reply", "with", "only",
)  # fmt: skip

# Each turn is `<|role|> content </s>`; the generation prompt opens the assistant's turn, so the
# model ends its answer with EOS.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|> ' + message['content'] + ' </s> ' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

# Whole words, single digits, `####` and single punctuation marks are the units.
_SPLIT_PATTERN = r"####|[0-9]|[^\W\d_]+|[^\w\s]|_"

# The tools variant: appended after the tokens above, whose ids stay as they are.
TOOL_ROLE = "<|tool|>"
TOOL_CALL_TOKENS = ("<tool_call>", "</tool_call>")
TOOL_TOKENS = (
    TOOL_ROLE, *TOOL_CALL_TOKENS, " ", "\n", "{", "}", "[", "]", '"', "'", "(", ")", "_",
    "name", "arguments", "tool", "tools", "calc", "add", "echo", "text", "result", "error",
    "when", "executing", "truncated", "type", "function", "description", "parameters",
    "properties", "object", "required", "integer", "string", "x", "y",
)  # fmt: skip
# As `_SPLIT_PATTERN`, with the tool-call markers whole and each whitespace character a token.
_TOOLS_SPLIT_PATTERN = r"<tool_call>|</tool_call>|####|[0-9]|[^\W\d_]+|[^\w\s]|_|\s"
# `<|role|>\n content </s>\n` per turn (ChatML's shape); `tools` as JSON lines in a system turn.
TOOLS_CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|system|>\ntools:\n' }}"
    "{% for tool in tools %}{{ tool | tojson }}{{ '\n' }}{% endfor %}{{ '</s>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '</s>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def vocabulary(tools: bool = False) -> dict[str, int]:
    """Token -> id; the special tokens come first so that pad is 0 and eos is 3. `tools` appends
    :data:`TOOL_TOKENS` (those not already there) after the default vocabulary."""
    tokens = [*SPECIAL_TOKENS, *DIGITS, *PUNCTUATION, *WORDS]
    if tools:
        tokens += [t for t in dict.fromkeys(TOOL_TOKENS) if t not in tokens]
    return {tok: i for i, tok in enumerate(tokens)}


def build_tokenizer(tools: bool = False) -> PreTrainedTokenizerFast:
    """A lower-casing word-level tokenizer with a whitespace pre-tokenizer and a chat template;
    `tools` gives the tools variant (see the module's docstring)."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel(vocab=vocabulary(tools), unk_token=UNK))
    tok.normalizer = normalizers.Lowercase()
    if tools:
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(_TOOLS_SPLIT_PATTERN), behavior="isolated")
        tok.decoder = decoders.Fuse()
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.WhitespaceSplit(),
                pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
            ]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
        additional_special_tokens=[*ROLES, TOOL_ROLE] if tools else list(ROLES),
        model_input_names=["input_ids", "attention_mask"],
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = TOOLS_CHAT_TEMPLATE if tools else CHAT_TEMPLATE
    return fast


def build_model(
    vocab_size: int,
    *,
    hidden_size: int = 128,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    intermediate_size: int = 1024,
    max_position_embeddings: int = 512,
    seed: int = 0,
) -> PreTrainedModel:
    """A randomly initialised ``LlamaForCausalLM`` (about 1M parameters with the defaults)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = vocabulary()
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_attention_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=vocab[PAD],
        bos_token_id=vocab[BOS],
        eos_token_id=vocab[EOS],
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = vocab[PAD]
    model.generation_config.bos_token_id = vocab[BOS]
    model.generation_config.eos_token_id = vocab[EOS]
    return model


def save_tiny(outdir: str | Path, *, seed: int = 0, tools: bool = False, **model_kwargs: int) -> Path:
    """Write the tiny model and its tokenizer (the tools variant with `tools`) to ``outdir``
    (created if missing)."""
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(tools)
    model = build_model(len(tokenizer), seed=seed, **model_kwargs)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def save_tiny_rm(outdir: str | Path, *, seed: int = 3) -> Path:
    """Write a tiny random Llama sequence classifier (one label: a discriminative reward model)
    with the tiny tokenizer to ``outdir``, its chat template starting with the BOS as Llama's
    does (verl strips that BOS when it renders the reward model's input)."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, num_labels=1)
    torch.manual_seed(seed)
    LlamaForSequenceClassification(config).save_pretrained(out)
    tok.chat_template = "{{ bos_token }}" + str(tok.chat_template)
    tok.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.tiny",
        description="Write a tiny random Llama model and word-level tokenizer to OUTDIR.",
    )
    parser.add_argument("outdir", help="directory to write (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--layers", type=int, default=2, help="number of decoder layers")
    parser.add_argument("--tools", action="store_true", help="the tools variant of the tokenizer")
    args = parser.parse_args(argv)
    out = save_tiny(args.outdir, seed=args.seed, tools=args.tools, num_hidden_layers=args.layers)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
