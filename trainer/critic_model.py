"""The critic: a value model (a causal LM's backbone with a linear value head), its build from
a model directory, and its values over a batch (verl's layout, :mod:`trainer.models`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from trainer.models import (
    Tokens,
    load_pretrained,
    micro_batches,
    select_tokens,
    to_model_device,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["CriticModel", "compute_values", "load_critic", "token_values"]


class CriticModel(nn.Module):
    """Value model: a causal LM's backbone with a linear head giving one value per token."""

    def __init__(self, backbone: PreTrainedModel, init_std: float = 0.02) -> None:
        super().__init__()
        self.backbone = backbone
        self.config = backbone.config
        hidden = backbone.config.hidden_size
        self.value_head = nn.Linear(hidden, 1, dtype=backbone.dtype)
        nn.init.normal_(self.value_head.weight, std=init_std)
        nn.init.zeros_(self.value_head.bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Values of shape ``(batch, seq_len)``, in float32 (``attention_mask`` None with
        packed ``position_ids``: one row of several sequences; `kwargs` go to the attention)."""
        out = self.backbone(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            **kwargs,
        )
        return self.value_head(out.last_hidden_state).squeeze(-1).float()


def load_critic(
    path: str | Path,
    *,
    dtype: str | torch.dtype = "float32",
    gradient_checkpointing: bool = False,
    attn_implementation: str = "sdpa",
    trust_remote_code: bool = False,
    config_updates: Mapping[str, Any] | None = None,
) -> CriticModel:
    """A critic whose backbone is initialised from the model at ``path`` (the LM head is
    dropped), its config edited by `config_updates`; the value head is new, drawn from the
    current torch RNG."""
    from transformers import AutoModel

    return CriticModel(load_pretrained(
        AutoModel, path, dtype=dtype, gradient_checkpointing=gradient_checkpointing,
        attn_implementation=attn_implementation, trust_remote_code=trust_remote_code,
        config_updates=config_updates, key="critic.model.override_config"))


def compute_values(
    critic: CriticModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_length: int,
    *,
    micro_batch_size: int | None = None,
    remove_padding: bool = False,
) -> torch.Tensor:
    """Critic values of the states before each response token, shape ``(batch, resp_len)``,
    zero at padding (``remove_padding`` as in :func:`compute_log_probs`)."""
    input_ids, attention_mask = to_model_device(critic, input_ids, attention_mask)
    values = []
    for sl in micro_batches(input_ids.shape[0], micro_batch_size):
        tokens = select_tokens(input_ids[sl], attention_mask[sl], response_length,
                               remove_padding=remove_padding)
        values.append(token_values(critic, tokens))
    return torch.cat(values)


def token_values(critic: CriticModel, tokens: Tokens) -> torch.Tensor:
    """The critic's values of `tokens`' response states, in a ``(batch, resp_len)`` tensor."""
    v = critic(tokens.input_ids, tokens.attention_mask, tokens.position_ids, **tokens.model_kwargs(critic))
    return tokens.scatter(v.reshape(-1)[tokens.predict_at])
