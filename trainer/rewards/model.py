"""A discriminative reward model: an `AutoModelForSequenceClassification` scoring the
chat-templated prompt and response, as verl 0.9.1's reward loop renders and scores them
(`verl/experimental/reward_loop/reward_loop.py`, `RewardLoopWorker._preprocess_reward_inputs` and
`compute_score_disrm`).

verl serves the model with vLLM's pooling runner and posts the rendered text to `/classify` with
`use_activation=False`, taking `data[-1]["probs"][-1]`: the last label's raw logit, pooled at the
last token (vLLM's classification pooler). Here an HF forward of the same text, tokenized as vLLM
tokenizes a `/classify` input (with the tokenizer's special tokens), gives that logit at its last
token. The responses are scored in micro-batches (sorted by length, left-padded, each row's own
positions, the padding masked), so a row's logit is its unpadded forward's up to rounding; the
head pools at the last position whatever its token (HF's own pooling would skip a last token
equal to `pad_token_id`, which vLLM's does not).

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

from trainer.config.reward import RM_TOKENS_PER_FORWARD as TOKENS_PER_FORWARD

__all__ = ["TOKENS_PER_FORWARD", "SequenceClassifierRM", "legacy_rm_ids", "micro_batches", "render_rm_prompt",
           "rm_dtype"]

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
    def score_texts(self, texts: Sequence[str | list[int]], rows_per_forward: int | None = None) -> list[float]:
        """The last label's logit at the last token of each text (vLLM `/classify`,
        `use_activation=False`, `probs[-1]`); a text given as token ids (:func:`legacy_rm_ids`) is
        scored as it is. The texts go through the model in micro-batches of at most
        `rows_per_forward` rows (null: any) and :data:`TOKENS_PER_FORWARD` padded tokens."""
        self.wake()
        ids = [list(self.tokenizer(t, add_special_tokens=True).input_ids) if isinstance(t, str) else list(t)
               for t in texts]
        scores: list[float] = [0.0] * len(ids)
        for batch in micro_batches([len(i) for i in ids], rows_per_forward, TOKENS_PER_FORWARD):
            for row, value in zip(batch, self._forward([ids[r] for r in batch]), strict=True):
                scores[row] = value
        return scores

    def _forward(self, rows: list[list[int]]) -> list[float]:
        """One forward of `rows`, left-padded: each row's positions count from its first token,
        its padding is masked, and the head's logit is read at the last position (the text's last
        token), with HF's pad-token search switched off."""
        width = max(len(r) for r in rows)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], dtype=torch.long, device=self.device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long,
                            device=self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        text_config = self.model.config.get_text_config()
        kept = text_config.pad_token_id
        text_config.pad_token_id = -1  # no id equals it: HF pools at the last position, as vLLM does
        try:
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        finally:
            text_config.pad_token_id = kept
        return [float(v) for v in logits[:, -1].float().tolist()]


def micro_batches(lengths: Sequence[int], rows: int | None, tokens: int) -> list[list[int]]:
    """Indices of `lengths` grouped for forwards: sorted by length (least padding), each group at
    most `rows` rows (null: any) and `tokens` padded tokens (its rows x its longest), a row longer
    than `tokens` alone."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    for i in order:
        group = groups[-1] if groups else None
        if group is not None and (rows is None or len(group) < rows) and (len(group) + 1) * lengths[i] <= tokens:
            group.append(i)
        else:
            groups.append([i])
    return groups
