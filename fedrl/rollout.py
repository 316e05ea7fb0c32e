"""Rollouts from any causal LM in fedrl: sample answers, record the actor's log-probs.

Prompts are left-padded so that every answer starts at the same column; answers are
right-padded after <eos>. The learner later recomputes log-probs on the same tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from fedrl.models import LoadedModel
from fedrl.tasks.base import Problem, Task

LogitHook = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class Rollouts:
    """S sampled answers for each of P prompts, flattened to B = P*S rows."""

    input_ids: torch.Tensor  # (B, T) prompt + answer
    attention_mask: torch.Tensor  # (B, T) 1 on real tokens
    answer_mask: torch.Tensor  # (B, T) 1 on the answer tokens that are scored
    behaviour_logp: torch.Tensor  # (B, T) actor log-prob of each answer token, 0 elsewhere
    group: torch.Tensor  # (B,) which prompt a row answers
    problems: list[Problem]  # (B,) the problem of each row
    answers: list[str]  # (B,) decoded answers
    version: torch.Tensor  # (B,) policy version that produced each row
    rewards: torch.Tensor = field(default=None)  # (B,) filled by `score`

    @property
    def prompt_len(self) -> int:
        return self.input_ids.shape[1] - self.answer_mask.shape[1] + self._answer_cols

    @property
    def _answer_cols(self) -> int:
        return self.answer_mask.shape[1]


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, so a padded prompt sees the same positions as an unpadded one."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = torch.as_tensor(list(s), dtype=torch.long)
        mask[i, width - len(s) :] = 1
    return ids, mask


@torch.no_grad()
def sample_tokens(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    greedy: bool = False,
    generator: torch.Generator | None = None,
    logit_hook: LogitHook | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Autoregressive sampling with a KV cache.

    Returns answer ids (B, A), the log-prob of each under the (possibly hooked) sampling
    distribution (B, A), and a mask (B, A) that is 1 up to and including <eos>.
    """
    batch = prompt_ids.shape[0]
    mask = prompt_mask.clone()
    out = model(input_ids=prompt_ids, attention_mask=mask, position_ids=position_ids(mask), use_cache=True)
    past, logits = out.past_key_values, out.logits[:, -1, :]
    tokens, logps = [], []
    alive = torch.ones(batch, dtype=torch.bool)
    alive_cols = []
    for step in range(max_new_tokens):
        logits = logits.float()
        if logit_hook is not None:
            logits = logit_hook(logits)
        logp_all = torch.log_softmax(logits, dim=-1)
        if greedy:
            tok = logp_all.argmax(-1)
        else:
            tok = torch.multinomial(logp_all.exp(), 1, generator=generator).squeeze(-1)
        tok = torch.where(alive, tok, torch.full_like(tok, pad_id))
        tokens.append(tok)
        logps.append(torch.where(alive, logp_all.gather(-1, tok[:, None]).squeeze(-1), torch.zeros(batch)))
        alive_cols.append(alive.clone())
        alive = alive & (tok != eos_id)
        if not alive.any() or step == max_new_tokens - 1:
            break
        mask = torch.cat([mask, torch.ones((batch, 1), dtype=mask.dtype)], dim=1)
        pos = (mask.sum(-1, keepdim=True) - 1).long()
        out = model(input_ids=tok[:, None], attention_mask=mask, position_ids=pos, past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1, :]
    return torch.stack(tokens, 1), torch.stack(logps, 1), torch.stack(alive_cols, 1).long()


def rollout(
    lm: LoadedModel,
    task: Task,
    problems: Sequence[Problem],
    samples_per_prompt: int = 1,
    greedy: bool = False,
    generator: torch.Generator | None = None,
    logit_hook: LogitHook | None = None,
    version: int = 0,
) -> Rollouts:
    """Sample `samples_per_prompt` answers per problem (rows of one prompt are adjacent)."""
    rows = [p for p in problems for _ in range(samples_per_prompt)]
    group = torch.arange(len(problems)).repeat_interleave(samples_per_prompt)
    prompt_ids, prompt_mask = left_pad([lm.prompt_ids(p.prompt, task.chat) for p in rows], lm.pad_token_id)
    answer, logp, answer_mask = sample_tokens(
        lm.model, prompt_ids, prompt_mask, task.max_answer_tokens, lm.eos_token_id, lm.pad_token_id,
        greedy=greedy, generator=generator, logit_hook=logit_hook,
    )
    width = prompt_ids.shape[1]
    input_ids = torch.cat([prompt_ids, answer], 1)
    attention_mask = torch.cat([prompt_mask, answer_mask], 1)
    full_answer_mask = torch.cat([torch.zeros_like(prompt_mask), answer_mask], 1)
    behaviour = torch.cat([torch.zeros(prompt_ids.shape), logp], 1) * full_answer_mask
    answers = [lm.decode(a[: int(m.sum())]) for a, m in zip(answer, answer_mask)]
    return Rollouts(
        input_ids=input_ids,
        attention_mask=attention_mask,
        answer_mask=full_answer_mask,
        behaviour_logp=behaviour,
        group=group,
        problems=rows,
        answers=answers,
        version=torch.full((len(rows),), version, dtype=torch.long),
    )


def score(task: Task, batch: Rollouts) -> Rollouts:
    batch.rewards = torch.tensor([task.reward(p, a) for p, a in zip(batch.problems, batch.answers)], dtype=torch.float32)
    return batch


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """log pi(token_t | tokens_<t) for t >= 1 (column 0 is 0); differentiable."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask)).logits
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros_like(logp[:, :1]), logp], 1)


@torch.no_grad()
def greedy_error(lm: LoadedModel, task: Task, problems: Sequence[Problem] | None = None, batch_size: int = 256) -> float:
    """Held-out metric: fraction of problems whose greedy answer is wrong."""
    problems = list(task.eval_problems() if problems is None else problems)
    wrong = 0
    for start in range(0, len(problems), batch_size):
        chunk = problems[start : start + batch_size]
        batch = rollout(lm, task, chunk, greedy=True)
        wrong += sum(not task.is_correct(p, a) for p, a in zip(chunk, batch.answers))
    return wrong / max(len(problems), 1)


def numpy_rng_to_torch(rng: np.random.Generator) -> torch.Generator:
    """A torch generator seeded from a numpy one: one seed drives both prompt and token sampling."""
    return torch.Generator().manual_seed(int(rng.integers(2**62)))
