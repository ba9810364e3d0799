"""A discriminative reward model: an `AutoModelForSequenceClassification` scoring the
chat-templated prompt and response, as verl 0.9.1's reward loop renders and scores them
(`verl/experimental/reward_loop/reward_loop.py`, `RewardLoopWorker._preprocess_reward_inputs` and
`compute_score_disrm`).

verl serves the model with vLLM's pooling runner and posts the rendered text to `/classify` with
`use_activation=False`, taking `data[-1]["probs"][-1]`: the last label's raw logit, pooled at the
last token (vLLM's classification pooler). Here an HF forward of the same text, tokenized as vLLM
tokenizes a `/classify` input (with the tokenizer's special tokens), gives that logit: HF's
sequence-classification head pools at the last token of an unpadded row. Each response is scored
alone, so no padding enters.

verl's legacy reward model worker (`reward_model.use_reward_loop=false`, `RewardModelWorker` of
`verl/workers/fsdp_workers.py` at b178a3cd; gone in 0.9.1) renders the same chat but keeps the
template's text whole (its BOS included) and tokenizes it with no special tokens added, cuts it
to `reward_model.max_length` tokens keeping the head, and reads the logit of a one-label
token-classification head (the same `score` weights) at the last kept token, in bf16:
:func:`legacy_rm_ids` and `dtype="bfloat16"` give those inputs here."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["SequenceClassifierRM", "legacy_rm_ids", "render_rm_prompt", "rm_dtype"]

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
           "float32": torch.float32, "fp32": torch.float32}


def rm_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """The reward model's weights dtype: `reward_model.rollout.dtype` (verl serves it in bf16 by
    default), null = bf16 on a GPU and fp32 on the CPU, as this trainer's `rollout.dtype`."""
    if name is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if str(name) not in _DTYPES:
        raise ValueError(f"`reward_model.rollout.dtype={name}`: one of {', '.join(_DTYPES)}")
    return _DTYPES[str(name)]


def render_rm_prompt(raw_prompt: list[dict[str, Any]], response_ids: list[int], input_tokenizer: Any,
                     rm_tokenizer: Any, keep_bos: bool = False) -> str:
    """verl's `_preprocess_reward_inputs`: the response decoded by the policy's tokenizer with its
    special tokens kept and the EOS text removed, appended to the row's chat messages as the
    assistant's turn, rendered by the reward model's chat template (no generation prompt, as
    text), without a leading BOS (the tokenizer adds it again when the text is tokenized), or with it
    (`keep_bos`, verl's legacy `_switch_chat_template`)."""
    response = str(input_tokenizer.decode(response_ids))
    eos = input_tokenizer.eos_token
    if eos:
        response = response.replace(eos, "")
    chat = [*raw_prompt, {"role": "assistant", "content": response}]
    text = str(rm_tokenizer.apply_chat_template(chat, add_generation_prompt=False, tokenize=False))
    bos = rm_tokenizer.bos_token
    if not keep_bos and bos is not None and text.startswith(bos):
        text = text[len(bos):]
    return text


def legacy_rm_ids(text: str, rm_tokenizer: Any, max_length: int) -> list[int]:
    """verl's legacy `_switch_chat_template` input: `text` (rendered with `keep_bos`) tokenized with
    no special tokens added, its first `max_length` tokens (`postprocess_data`, `truncation="right"`)."""
    return list(rm_tokenizer(text, add_special_tokens=False).input_ids)[:max_length]


class SequenceClassifierRM:
    """The reward model's weights and tokenizer, on `device` while scoring and on the CPU between
    scorings (:meth:`sleep`, :meth:`wake`): a colocated reward model holds no device memory while
    the actor trains (verl's colocated reward model sleeps likewise, `RewardLoopManager.compute_rm_score`)."""

    def __init__(self, path: str, device: torch.device, dtype: str | None = None,
                 trust_remote_code: bool = False) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            path, trust_remote_code=trust_remote_code, torch_dtype=rm_dtype(dtype, device)).eval()
        self.device = device
        self.awake = False

    @property
    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def wake(self) -> None:
        if not self.awake:
            self.model.to(self.device)
            self.awake = True

    def sleep(self) -> None:
        if self.awake:
            self.model.to("cpu")
            self.awake = False
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    @torch.no_grad()
    def score_texts(self, texts: Sequence[str | list[int]]) -> list[float]:
        """The last label's logit at the last token of each text (vLLM `/classify`,
        `use_activation=False`, `probs[-1]`); a text given as token ids (:func:`legacy_rm_ids`) is
        scored as it is."""
        self.wake()
        scores = []
        for text in texts:
            if isinstance(text, str):
                ids = self.tokenizer(text, add_special_tokens=True, return_tensors="pt").input_ids.to(self.device)
            else:
                ids = torch.tensor([text], dtype=torch.long, device=self.device)
            logits = self.model(input_ids=ids).logits
            scores.append(float(logits[0, -1].float()))
        return scores
