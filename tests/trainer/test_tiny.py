"""The tiny model directory loads through the Auto classes and tokenizes the toy tasks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from trainer import tiny


def test_loads_with_auto_classes(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert type(model).__name__ == "LlamaForCausalLM"
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_attention_heads) == (128, 4)
    assert cfg.hidden_size // cfg.num_attention_heads == 32
    assert 0.5e6 < sum(p.numel() for p in model.parameters()) < 2e6
    assert cfg.vocab_size == len(tok)
    assert (tok.pad_token, tok.eos_token, tok.bos_token) == ("<pad>", "</s>", "<s>")
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert tok.model_input_names == ["input_ids", "attention_mask"]
    assert tok.padding_side == "left"


def test_vocabulary_covers_the_toy_tasks(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    vocab = tok.get_vocab()
    required = [*tiny.ROLES, *"0123456789", "####", "+", "-", "=", "?", ".", ","]
    required += ["copy", "say", "sevens", "the", "digit", "answer"]
    assert not [t for t in required if t not in vocab]
    text = "Copy the digit 7, say sevens? #### 3+4=7."
    ids = tok(text)["input_ids"]
    assert tok.unk_token_id not in ids
    assert tok.decode(ids) == "copy the digit 7 , say sevens ? #### 3 + 4 = 7 ."
    assert tok("zebra")["input_ids"] == [tok.unk_token_id]


def test_chat_template_ends_with_assistant_marker(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    msgs = [{"role": "system", "content": "answer"}, {"role": "user", "content": "copy 5"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|system|> answer </s> <|user|> copy 5 </s> <|assistant|>"
    toks = tok.convert_ids_to_tokens(tok(text)["input_ids"])
    assert toks == [
        "<|system|>",
        "answer",
        "</s>",
        "<|user|>",
        "copy",
        "5",
        "</s>",
        "<|assistant|>",
    ]


def test_seed_fixes_the_weights() -> None:
    a = tiny.build_model(len(tiny.vocabulary()), seed=1)
    b = tiny.build_model(len(tiny.vocabulary()), seed=1)
    c = tiny.build_model(len(tiny.vocabulary()), seed=2)
    wa, wb, wc = (m.model.embed_tokens.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)


def test_cli_writes_a_loadable_directory(tmp_path: Path) -> None:
    out = tmp_path / "m"
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.tiny", str(out), "--seed", "3"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    assert (out / "model.safetensors").is_file()
