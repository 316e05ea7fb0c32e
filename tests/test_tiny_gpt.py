import numpy as np
import pytest
import torch

from fedrl.blocks import BlockPartition
from fedrl.kv_cache import cache_of
from fedrl.lora import LoraSettings, add_lora
from fedrl.models import load_model, tiny_gpt_model
from fedrl.rollout import left_pad, position_ids
from fedrl.tiny_gpt import TinyGPTConfig


@pytest.mark.parametrize("name", ["cache", "past_key_values"])
def test_cached_decoding_matches_one_full_forward_on_left_padded_prompts(name):
    """Under either name transformers has given the KV cache: one a caller used and the model
    dropped would decode without it."""
    lm = tiny_gpt_model(0, alphabet="01")
    ids, mask = left_pad([lm.tokenizer.encode_prompt(p) for p in ["0110", "1", "001"]], lm.pad_token_id)
    new = torch.tensor([[4, 5], [5, 5], [4, 4]])
    full_ids, full_mask = torch.cat([ids, new], 1), torch.cat([mask, torch.ones_like(new)], 1)
    with torch.no_grad():
        full = lm.model(full_ids, attention_mask=full_mask, position_ids=position_ids(full_mask)).logits
        out = lm.model(ids, attention_mask=mask, position_ids=position_ids(mask), use_cache=True)
        steps = [out.logits[:, -1]]
        for col in range(new.shape[1]):
            m = full_mask[:, : ids.shape[1] + col + 1]
            out = lm.model(
                new[:, col : col + 1],
                attention_mask=m,
                position_ids=position_ids(m)[:, -1:],
                use_cache=True,
                **{name: cache_of(out)},
            )
            steps.append(out.logits[:, -1])
    real = full_mask.bool()
    assert torch.isfinite(full).all()  # pad queries see themselves: no all-masked softmax row
    for col, logits in enumerate(steps):
        assert torch.allclose(logits, full[:, ids.shape[1] - 1 + col], atol=1e-5)
    # a left-padded prompt gives the same logits as the same prompt alone
    with torch.no_grad():
        alone = lm.model(torch.tensor([lm.tokenizer.encode_prompt("1")])).logits
    assert torch.allclose(alone[0], full[1, real[1]][: alone.shape[1]], atol=1e-5)


def test_init_follows_lecun_normal_and_the_papers_shapes():
    lm = tiny_gpt_model(0, alphabet="01")
    params = dict(lm.model.named_parameters())
    assert not any("bias" in n for n in params)  # no biases anywhere, as the reference
    assert params["layers.0.ff_up.weight"].shape == (128, 64)
    assert params["pos_emb.weight"].shape == (TinyGPTConfig().max_positions, 64)
    for name in ("layers.1.qkv.weight", "layers.2.ff_down.weight", "token_emb.weight"):
        w = params[name]
        assert abs(w.std().item() * w.shape[1] ** 0.5 - 1) < 0.15, name


def test_lora_blocks_cover_each_layer_and_only_the_adapter_trains():
    model = add_lora(load_model("tiny-gpt", seed=1).model, LoraSettings(rank=4))
    partition = BlockPartition(model, 3)
    for block in range(3):
        names = partition.names(block)
        assert names and all(f"layers.{block}." in n for n in names)
        assert {n.split(".")[-4] for n in names} == {"qkv", "out", "ff_up", "ff_down"}
    base = {n: p.clone() for n, p in model.named_parameters() if "lora_" not in n}
    trainable = partition.make_trainable(model, 1)
    opt = torch.optim.SGD(trainable, lr=0.1)
    ids = torch.tensor([[1, 4, 5, 2, 4]])
    model(input_ids=ids).logits.sum().backward()
    opt.step()
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if n in base)


def test_bad_config_and_too_long_inputs_are_refused():
    with pytest.raises(ValueError, match="multiple of num_heads"):
        TinyGPTConfig(hidden_size=30, num_heads=4)
    lm = tiny_gpt_model(0, alphabet="01")
    with pytest.raises(ValueError, match="learned positions"):
        lm.model(torch.ones(1, TinyGPTConfig().max_positions + 1, dtype=torch.long))


def test_same_seed_same_weights_and_positions_matter():
    a, b = tiny_gpt_model(2, alphabet="01"), tiny_gpt_model(2, alphabet="01")
    assert all(torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters()))
    ids = torch.tensor(np.array([[1, 4, 4, 5, 2]]))
    with torch.no_grad():
        logits = a.model(ids).logits[0]
    assert not torch.allclose(logits[1], logits[2])  # same token, different position
