import pytest
import torch

from fedrl.blocks import ALL_BLOCKS, BlockPartition, layer_index, lora_parameter_names
from fedrl.lora import LoraSettings, add_lora
from fedrl.models import load_model


@pytest.fixture
def peft_tiny():
    return add_lora(load_model("tiny", seed=0).model, LoraSettings(rank=4))


@pytest.mark.parametrize("num_blocks", [1, 2, 3])
def test_partition_covers_every_lora_parameter_exactly_once(peft_tiny, num_blocks):
    part = BlockPartition(peft_tiny, num_blocks)
    flat = [n for b in range(num_blocks) for n in part.names(b)]
    assert sorted(flat) == sorted(lora_parameter_names(peft_tiny))
    assert len(flat) == len(set(flat))
    # consecutive layers: block index never decreases with the layer index
    assert [part.block_of(n) for n in sorted(flat, key=layer_index)] == sorted(part.block_of(n) for n in flat)
    assert all(part.names(b) for b in range(num_blocks))
    assert part.names(ALL_BLOCKS) == flat  # the whole adapter, in block order


def test_only_the_chosen_block_receives_gradients(peft_tiny):
    part = BlockPartition(peft_tiny, 3)
    part.make_trainable(peft_tiny, 1)
    # B matrices start at zero, so A gets no gradient on the first step: nudge B first
    with torch.no_grad():
        for name, p in peft_tiny.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    ids = torch.randint(4, 16, (4, 10))
    peft_tiny(input_ids=ids, labels=ids).loss.backward()
    for name, p in peft_tiny.named_parameters():
        if name in part.names(1):
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None, name


def test_get_and_set_one_block(peft_tiny):
    part = BlockPartition(peft_tiny, 3)
    new = {n: torch.full_like(t, 0.5) for n, t in part.get(peft_tiny, 2).items()}
    before_other = part.get(peft_tiny, 0)
    part.set(peft_tiny, 2, new)
    assert all(torch.equal(t, new[n]) for n, t in part.get(peft_tiny, 2).items())
    assert all(torch.equal(t, before_other[n]) for n, t in part.get(peft_tiny, 0).items())


def test_set_refuses_wrong_names_or_shapes_and_changes_nothing(peft_tiny):
    part = BlockPartition(peft_tiny, 3)
    good = part.get(peft_tiny, 0)
    with pytest.raises(ValueError, match="do not match"):
        part.set(peft_tiny, 0, dict(list(good.items())[1:]))
    bad = dict(good)
    name = next(iter(bad))
    bad[name] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="shape"):
        part.set(peft_tiny, 0, bad)
    assert all(torch.equal(t, good[n]) for n, t in part.get(peft_tiny, 0).items())
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPartition(peft_tiny, 4)
    with pytest.raises(ValueError, match="no LoRA"):
        BlockPartition(load_model("tiny").model, 1)


def test_adapter_difference_names_the_first_tensor_that_differs():
    from fedrl.blocks import adapter_difference

    state = {"a": torch.zeros(2, 3), "b": torch.zeros(4)}
    assert adapter_difference(dict(state), state) == ""
    assert adapter_difference({"a": state["a"]}, state) == "b is missing"
    assert adapter_difference({**state, "c": torch.zeros(1)}, state) == "c is not expected"
    assert adapter_difference({**state, "a": torch.zeros(3, 2)}, state) == (
        "a has shape (3, 2) and torch.float32, expected (2, 3) and torch.float32"
    )
    assert "torch.bfloat16, expected (4,) and torch.float32" in adapter_difference(
        {**state, "b": torch.zeros(4, dtype=torch.bfloat16)}, state
    )
