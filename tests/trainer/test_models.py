"""Model loading and the response forward passes (`trainer.models`, `trainer.critic_model`,
`trainer.logits`, `trainer.model_shards`), on the tiny model (and SmolLM2 when present)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainer import critic_model, model_shards, models
from trainer.algos.core_algos import entropy_from_logits
from trainer.logits import entropy_chunked, log_probs_from_logits

PROMPTS = [[5, 26, 14, 3, 6], [5, 27, 3, 6], [5, 26, 30, 31, 17, 9, 3, 6]]
RESPONSES = [[17, 9, 3], [40, 41, 42, 43], [3]]  # 3 is EOS
PAD = 0


@pytest.fixture(scope="module")
def actor(tiny_model_dir: Path) -> torch.nn.Module:
    return models.load_actor(tiny_model_dir).eval()


def make_batch() -> tuple[torch.Tensor, torch.Tensor, int]:
    """Left-padded prompts followed by right-padded responses, verl's layout."""
    p_ids, p_mask = models.left_pad(PROMPTS, PAD)
    width = max(len(r) for r in RESPONSES)
    r_ids = torch.full((len(RESPONSES), width), PAD)
    r_mask = torch.zeros((len(RESPONSES), width), dtype=torch.long)
    for i, r in enumerate(RESPONSES):
        r_ids[i, : len(r)] = torch.tensor(r)
        r_mask[i, : len(r)] = 1
    return torch.cat([p_ids, r_ids], 1), torch.cat([p_mask, r_mask], 1), width


def unpadded_log_probs(model: torch.nn.Module, i: int, temperature: float = 1.0) -> torch.Tensor:
    """Reference: the sequence alone, no padding at all."""
    ids = torch.tensor([PROMPTS[i] + RESPONSES[i]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(PROMPTS[i]) - 1 : -1] / temperature
    return torch.log_softmax(logits, -1).gather(-1, ids[0, len(PROMPTS[i]) :, None])[:, 0]


def test_position_ids_and_left_pad() -> None:
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]])
    assert models.position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 3]]
    ids, m = models.left_pad([[7, 8], [9]], pad_token_id=0, length=3)
    assert ids.tolist() == [[0, 7, 8], [0, 0, 9]] and m.tolist() == [[0, 1, 1], [0, 0, 1]]
    with pytest.raises(ValueError, match="more than the padded length 1"):
        models.left_pad([[7, 8]], pad_token_id=0, length=1)


def test_log_probs_match_unpadded_forward(actor: torch.nn.Module) -> None:
    ids, mask, resp_len = make_batch()
    with torch.no_grad():
        lp, ent = models.compute_log_probs(
            actor, ids, mask, resp_len, temperature=0.7, calculate_entropy=True
        )
    assert lp.shape == ent.shape == (3, resp_len)
    for i, r in enumerate(RESPONSES):
        torch.testing.assert_close(
            lp[i, : len(r)], unpadded_log_probs(actor, i, 0.7), atol=1e-5, rtol=0
        )


def test_micro_batches_and_entropy(actor: torch.nn.Module) -> None:
    ids, mask, resp_len = make_batch()
    with torch.no_grad():
        whole, ent = models.compute_log_probs(actor, ids, mask, resp_len, calculate_entropy=True)
        split, ent2 = models.compute_log_probs(
            actor, ids, mask, resp_len, micro_batch_size=2, calculate_entropy=True
        )
        logits = actor(
            input_ids=ids, attention_mask=mask, position_ids=models.position_ids_from_mask(mask)
        ).logits[:, -resp_len - 1 : -1]
    torch.testing.assert_close(split, whole, atol=1e-6, rtol=0)
    torch.testing.assert_close(ent2, ent, atol=1e-6, rtol=0)
    torch.testing.assert_close(ent, entropy_from_logits(logits) * mask[:, -resp_len:], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="temperature"):
        models.compute_log_probs(actor, ids, mask, resp_len, temperature=0.0)


def test_remove_padding_gives_the_padded_paths_log_probs_and_values(actor: torch.nn.Module,
                                                                    tiny_model_dir: Path) -> None:
    """Packed sequences (one row, position ids restarting per sequence, SDPA's block-diagonal
    mask) give the padded forward's log-probs, entropies and values to 1e-5 in fp32."""
    ids, mask, resp_len = make_batch()
    ids, mask = torch.cat([ids, torch.zeros(3, 2, dtype=ids.dtype)], 1), torch.cat([mask, torch.zeros(3, 2, dtype=mask.dtype)], 1)
    resp_len += 2  # two all-padding columns, which neither path computes
    with torch.no_grad():
        out = {rp: models.compute_log_probs(actor, ids, mask, resp_len, temperature=0.7,
                                            calculate_entropy=True, remove_padding=rp) for rp in (False, True)}
        full = actor(input_ids=ids, attention_mask=mask, position_ids=models.position_ids_from_mask(mask)
                     ).logits[:, -resp_len - 1:-1] / 0.7
    reference = torch.log_softmax(full, -1).gather(-1, ids[:, -resp_len:, None])[..., 0] * mask[:, -resp_len:]
    for rp in (False, True):
        torch.testing.assert_close(out[rp][0], reference, atol=1e-5, rtol=0)
        torch.testing.assert_close(out[rp][1], entropy_from_logits(full) * mask[:, -resp_len:], atol=1e-5, rtol=0)
    torch.manual_seed(0)
    critic = critic_model.load_critic(tiny_model_dir)
    with torch.no_grad():
        values = [critic_model.compute_values(critic, ids, mask, resp_len, remove_padding=rp) for rp in (False, True)]
    torch.testing.assert_close(values[1], values[0], atol=1e-5, rtol=0)
    assert values[0][2, 1:].abs().sum() == 0  # row 2's response is one token


def test_packed_sequences_are_attended_apart_without_a_dense_mask(tiny_model_dir: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The attention the workers load (`attention_implementation`, on the CPU: SDPA one packed
    sequence at a time) gives the padded path's log-probs, values and gradients, and no SDPA call
    of the packed forward gets a mask: transformers' own `sdpa` builds a dense (T, T)
    block-diagonal mask for a packed row (T = every real token of the micro-batch)."""
    ids, mask, resp_len = make_batch()
    attention = models.attention_implementation(torch.device("cpu"), torch.float32)
    actor = models.load_actor(tiny_model_dir, attn_implementation=attention)
    masks: list[object] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        given = kwargs.get("attn_mask")
        masks.append(None if given is None else tuple(given.shape))  # type: ignore[attr-defined]
        return sdpa(*args, **kwargs)  # type: ignore[arg-type]

    grads: list[torch.Tensor] = []
    padded = torch.empty(0)
    for rp in (False, True):
        actor.zero_grad()
        masks.clear()
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
        lp, _ = models.compute_log_probs(actor, ids, mask, resp_len, temperature=0.7, remove_padding=rp)
        monkeypatch.undo()
        if rp:
            assert masks and all(m is None for m in masks), masks  # no (1, 1, T, T) mask
            assert len(masks) == 3 * actor.config.num_hidden_layers  # one call per sequence and layer
            torch.testing.assert_close(lp, padded, atol=1e-5, rtol=0)
        padded = lp.detach()
        lp.sum().backward()
        grads.append(actor.model.layers[0].self_attn.q_proj.weight.grad.clone())
    torch.testing.assert_close(grads[1], grads[0], atol=1e-5, rtol=1e-4)
    torch.manual_seed(0)
    critic = critic_model.load_critic(tiny_model_dir, attn_implementation=attention)
    with torch.no_grad():
        values = [critic_model.compute_values(critic, ids, mask, resp_len, remove_padding=rp) for rp in (False, True)]
    torch.testing.assert_close(values[1], values[0], atol=1e-5, rtol=0)


def test_chunked_log_probs_and_entropy_equal_full_log_softmax() -> None:
    """The gathered log-sum-exp over chunks of 3 positions equals the full `log_softmax`, with
    the same gradient, in fp32 (1e-6) and from bf16 logits (computed in fp32, 1e-6)."""
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(2, 5, 11) * 3).to(dtype).requires_grad_(True)
        labels = torch.randint(0, 11, (2, 5))
        chunked = log_probs_from_logits(logits, labels, chunk=3)
        full = torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None])[..., 0]
        torch.testing.assert_close(chunked, full, atol=1e-6, rtol=0)
        weights = torch.randn(2, 5)
        (g_chunked,) = torch.autograd.grad((chunked * weights).sum(), logits)
        (g_full,) = torch.autograd.grad((full * weights).sum(), logits)
        torch.testing.assert_close(g_chunked, g_full)
        ent = entropy_chunked(logits, chunk=3)
        torch.testing.assert_close(ent, entropy_from_logits(logits.float()), atol=1e-5, rtol=0)
        (g_ent,) = torch.autograd.grad(ent.sum(), logits)
        (g_ref,) = torch.autograd.grad(entropy_from_logits(logits.float()).sum(), logits)
        torch.testing.assert_close(g_ent, g_ref)


def test_autocast_computes_in_bf16_and_keeps_fp32_master_weights(tiny_model_dir: Path) -> None:
    """One rank's mixed precision: bf16 logits, fp32 parameters and gradients, log-probs within
    bf16 rounding of the fp32 ones."""
    from trainer import parallel

    ids, mask, resp_len = make_batch()
    fp32 = models.load_actor(tiny_model_dir)
    with torch.no_grad():
        ref, _ = models.compute_log_probs(fp32, ids, mask, resp_len)
    model = parallel.apply_autocast(models.load_actor(tiny_model_dir), torch.bfloat16)
    assert model(input_ids=ids[:1]).logits.dtype == torch.bfloat16
    lp, _ = models.compute_log_probs(model, ids, mask, resp_len, remove_padding=True)
    assert lp.dtype == torch.float32 and not torch.equal(lp, ref)
    torch.testing.assert_close(lp, ref, atol=0.1, rtol=0)
    lp.sum().backward()
    w = model.model.layers[0].mlp.up_proj.weight
    assert w.dtype == w.grad.dtype == torch.float32 and w.grad.abs().sum() > 0


def test_gradient_checkpointing_gives_the_same_gradients(tiny_model_dir: Path) -> None:
    ids, mask, resp_len = make_batch()
    grads = []
    for ckpt in (False, True):
        model = models.load_actor(tiny_model_dir, gradient_checkpointing=ckpt).train()
        lp, _ = models.compute_log_probs(model, ids, mask, resp_len)
        lp.sum().backward()
        grads.append(model.model.layers[0].self_attn.q_proj.weight.grad.clone())
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    torch.testing.assert_close(grads[1], grads[0], atol=1e-6, rtol=1e-5)


def test_critic_values(tiny_model_dir: Path) -> None:
    torch.manual_seed(0)
    critic = critic_model.load_critic(tiny_model_dir)
    ids, mask, resp_len = make_batch()
    values = critic_model.compute_values(critic, ids, mask, resp_len, micro_batch_size=2)
    assert values.shape == (3, resp_len) and values.dtype == torch.float32
    # The value before response token j of row 1 equals the unpadded forward's.
    alone = torch.tensor([PROMPTS[1] + RESPONSES[1]])
    with torch.no_grad():
        ref = critic(alone, torch.ones_like(alone))[0, len(PROMPTS[1]) - 1 : -1]
    torch.testing.assert_close(values[1].detach(), ref, atol=1e-5, rtol=0)
    values.sum().backward()
    assert critic.value_head.weight.grad is not None
    assert critic.backbone.layers[0].mlp.up_proj.weight.grad.abs().sum() > 0
    assert "value_head.weight" in critic.state_dict()


def test_dtype_and_path_errors(tiny_model_dir: Path, tmp_path: Path) -> None:
    assert models.resolve_dtype("bf16") is torch.bfloat16
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert (models.compute_dtype(None, cpu), models.compute_dtype(None, gpu)) == (torch.float32, torch.bfloat16)
    assert models.compute_dtype("bf16", cpu) is torch.bfloat16
    assert models.attention_implementation(cpu, torch.bfloat16) == models.PACKED_SDPA
    assert models.attention_implementation(gpu, torch.float32) == models.PACKED_SDPA  # flash-attn needs 16 bits
    assert models.load_actor(tiny_model_dir, dtype="bfloat16").dtype == torch.bfloat16
    with pytest.raises(ValueError, match="Valid values: float32"):
        models.resolve_dtype("float8")
    with pytest.raises(FileNotFoundError, match="not a directory"):
        models.resolve_model_path(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        models.resolve_model_path(tmp_path / "x.gguf")
    (tmp_path / "y.gguf").write_bytes(b"")
    assert models.resolve_model_path(tmp_path / "y.gguf") == (str(tmp_path), "y.gguf")


@pytest.mark.slow
def test_smollm2_gguf_loads_and_answers(smollm2_dir: Path) -> None:
    """`smollm2_dir` is the GGUF converted by `convert_to_hf`; the HF copy loads and answers."""
    out = smollm2_dir
    tok = models.load_tokenizer(out)
    model = models.load_actor(out).eval()
    assert model.config.num_hidden_layers == 30 and tok.padding_side == "left"
    chat = [{"role": "user", "content": "What is 2+3?"}]
    enc = tok.apply_chat_template(
        chat, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out_ids = model.generate(**enc, max_new_tokens=12, do_sample=False)
    assert "5" in tok.decode(out_ids[0, enc["input_ids"].shape[1] :])


def test_a_rank_reads_its_own_shards_and_a_missing_tensor_is_named(tiny_model_dir: Path, tmp_path: Path) -> None:
    """`load_local_shards` on one rank reads the whole model as `from_pretrained` does; a file
    lacking one of the model's tensors is refused, naming it."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    M = models
    model = M.materialize(model_shards.empty_placed_actor(tiny_model_dir), torch.device("cpu"))
    model_shards.load_local_shards(model, tiny_model_dir)
    for key, value in AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=0, atol=0, msg=key)

    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    [file] = model_shards.safetensors_files(broken)
    tensors = load_file(file)
    del tensors["model.norm.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"hold no tensor named `model.norm.weight`"):
        model_shards.load_local_shards(model, broken)
