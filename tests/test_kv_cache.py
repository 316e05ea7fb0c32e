import inspect
import logging
import warnings

import numpy as np
import pytest
import torch
import transformers.utils.logging as hf_logging

from fedrl.kv_cache import CACHE, select_rows
from fedrl.lora import add_lora
from fedrl.models import TINY_MODELS
from fedrl.rollout import rollout, token_logprobs
from fedrl.tasks import ReversalTask


class Recorded(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("spec", sorted(TINY_MODELS))
def test_cached_sampling_and_shared_prompt_scoring_pass_no_deprecated_cache_name(spec, lora):
    """transformers 5 deprecates `past_key_values` (removed in 5.40): a model that took the old
    name would break, or silently run without its cache, on the next release. Sampling with the
    KV cache and scoring a shared prompt once must go through the installed version's name,
    through a peft adapter too, and give what one full pass gives."""
    lm, task = TINY_MODELS[spec](0, alphabet="01"), ReversalTask(length=5)
    problems = task.sample(3, np.random.default_rng(0))
    if lora:
        lm.model = add_lora(lm.model)
    hf_logging.logging.Logger.warning_once.cache_clear()  # said once a process: say it again here
    recorded = Recorded()
    hf_logging.get_logger("transformers").addHandler(recorded)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            warnings.simplefilter("error", DeprecationWarning)
            batch = rollout(lm, task, problems, 4, generator=torch.Generator())
            scored = token_logprobs(*batch_args(lm, batch), batch.answer_start)
    finally:
        hf_logging.get_logger("transformers").removeHandler(recorded)
    assert not [m for m in recorded.messages if "deprecated" in m], recorded.messages
    # a cache dropped on the way would change what was sampled and scored: both match a full pass
    full, answer = token_logprobs(*batch_args(lm, batch)), batch.answer_mask.bool()
    assert torch.allclose(batch.behaviour_logp[answer], full[answer], atol=1e-5)
    assert torch.allclose(scored[answer], full[answer], atol=1e-5)


def batch_args(lm, batch):
    return lm.model, batch.input_ids, batch.attention_mask, batch.allowed


def test_the_cache_is_named_as_the_installed_transformers_names_it():
    from transformers import LlamaForCausalLM

    assert CACHE in inspect.signature(LlamaForCausalLM.forward).parameters


def test_select_rows_picks_rows_of_a_tuple_cache_in_order():
    k, v = torch.arange(6.0).view(3, 1, 1, 2), -torch.arange(6.0).view(3, 1, 1, 2)
    picked = select_rows(((k, v),), torch.tensor([2, 0, 2]))
    assert torch.equal(picked[0][0], k[[2, 0, 2]]) and torch.equal(picked[0][1], v[[2, 0, 2]])
