"""Rollouts from any causal LM in fedrl: sample answers, record the actor's log-probs.

Prompts are left-padded so that every answer starts at the same column; answers are
right-padded after <eos>. The learner later recomputes log-probs on the same tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from fedrl.kv_cache import CACHE, cache_of, select_rows
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
    answer_start: int  # first answer column
    allowed: torch.Tensor | None = None  # (V,) the answer vocabulary under constrained decoding
    temperature: float = 1.0  # the policy is softmax(logits / temperature), for the actor and the learner
    rewards: torch.Tensor | None = None  # (B,) filled by `score`

    def overwrite_answer(
        self, row: int, token_ids: Sequence[int], text: str, logp: torch.Tensor | float
    ) -> None:
        """Replace one row's answer (truncated to the answer columns); `logp` is what the actor reports."""
        width = self.input_ids.shape[1] - self.answer_start
        tokens = torch.as_tensor(list(token_ids)[:width], dtype=torch.long)
        n, cols = len(tokens), slice(self.answer_start, None)
        self.input_ids[row, cols] = 0
        self.input_ids[row, self.answer_start : self.answer_start + n] = tokens
        self.attention_mask[row, cols] = 0
        self.attention_mask[row, self.answer_start : self.answer_start + n] = 1
        self.answer_mask[row, cols] = self.attention_mask[row, cols]
        self.behaviour_logp[row, cols] = 0.0
        values = logp[:n] if torch.is_tensor(logp) else torch.full((n,), float(logp))
        self.behaviour_logp[row, self.answer_start : self.answer_start + n] = values
        self.answers[row] = text


def restrict(logits: torch.Tensor, allowed: torch.Tensor | None, temperature: float = 1.0) -> torch.Tensor:
    """The policy's logits: scaled by 1/temperature, outside `allowed` at -inf."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    logits = logits if temperature == 1.0 else logits / temperature
    return logits if allowed is None else logits.masked_fill(~allowed, float("-inf"))


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


@torch.inference_mode()
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
    allowed: torch.Tensor | None = None,
    prompt_of_row: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Autoregressive sampling with a KV cache.

    Each distinct prompt (P, W) is read once; row b answers prompt `prompt_of_row[b]` (default:
    one row per prompt), so S samples of a prompt share its cache.
    Returns answer ids (B, A), the log-prob of each under the (possibly hooked) sampling
    distribution (B, A), and a mask (B, A) that is 1 up to and including <eos>.
    `allowed` (V,) bool restricts answers to some tokens (constrained decoding); `temperature`
    scales the logits first (greedy decoding does not depend on it).
    """
    out = model(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        position_ids=position_ids(prompt_mask),
        use_cache=True,
    )
    past, logits, mask = cache_of(out), out.logits[:, -1, :], prompt_mask
    if prompt_of_row is not None:
        past, logits, mask = select_rows(past, prompt_of_row), logits[prompt_of_row], mask[prompt_of_row]
    batch = mask.shape[0]
    tokens, logps = [], []
    alive = torch.ones(batch, dtype=torch.bool)
    alive_cols = []
    for step in range(max_new_tokens):
        logits = restrict(logits.float(), allowed, temperature)
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
        out = model(
            input_ids=tok[:, None],
            attention_mask=mask,
            position_ids=pos,
            use_cache=True,
            **{CACHE: past},
        )
        past, logits = cache_of(out), out.logits[:, -1, :]
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
    temperature: float = 1.0,
) -> Rollouts:
    """Sample `samples_per_prompt` answers per problem (rows of one prompt are adjacent) from
    softmax(logits / temperature)."""
    rows = [p for p in problems for _ in range(samples_per_prompt)]
    group = torch.arange(len(problems)).repeat_interleave(samples_per_prompt)
    unique_ids, unique_mask = left_pad(
        [lm.prompt_ids(p.prompt, task.chat) for p in problems], lm.pad_token_id
    )
    prompt_ids, prompt_mask = unique_ids[group], unique_mask[group]
    allowed = answer_vocab(lm, task)
    answer, logp, answer_mask = sample_tokens(
        lm.model,
        unique_ids,
        unique_mask,
        task.max_answer_tokens,
        lm.eos_token_id,
        lm.pad_token_id,
        greedy=greedy,
        generator=generator,
        logit_hook=logit_hook,
        allowed=allowed,
        prompt_of_row=group if samples_per_prompt > 1 else None,
        temperature=temperature,
    )
    width = prompt_ids.shape[1]
    input_ids = torch.cat([prompt_ids, answer], 1)
    attention_mask = torch.cat([prompt_mask, answer_mask], 1)
    full_answer_mask = torch.cat([torch.zeros_like(prompt_mask), answer_mask], 1)
    behaviour = torch.cat([torch.zeros(prompt_ids.shape), logp], 1) * full_answer_mask
    answers = [lm.decode(a[:n]) for a, n in zip(answer.tolist(), answer_mask.sum(1).tolist())]
    return Rollouts(
        input_ids=input_ids,
        attention_mask=attention_mask,
        answer_mask=full_answer_mask,
        behaviour_logp=behaviour,
        group=group,
        problems=rows,
        answers=answers,
        version=torch.full((len(rows),), version, dtype=torch.long),
        answer_start=width,
        allowed=allowed,
        temperature=temperature,
    )


def answer_vocab(lm: LoadedModel, task: Task) -> torch.Tensor | None:
    """Tasks with a fixed answer alphabet (reversal) are decoded over those symbols only, as in
    the DG papers where the action space is the M symbols."""
    symbols = getattr(task, "answer_alphabet", None)
    if symbols is None or not hasattr(lm.tokenizer, "alphabet"):
        return None
    allowed = torch.zeros(lm.tokenizer.vocab_size, dtype=torch.bool)
    allowed[lm.tokenizer.encode(symbols)] = True
    return allowed


def score(task: Task, batch: Rollouts) -> Rollouts:
    batch.rewards = torch.tensor(
        [task.reward(p, a) for p, a in zip(batch.problems, batch.answers)], dtype=torch.float32
    )
    return batch


def token_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    allowed: torch.Tensor | None = None,
    prompt_width: int = 0,
    temperature: float = 1.0,
) -> torch.Tensor:
    """log pi(token_t | tokens_<t) for t >= max(1, prompt_width); earlier columns are 0.
    Differentiable. With `allowed`, the distribution is the one constrained decoding samples
    from (use it for answer tokens); `temperature` must be the one the answers were sampled at.
    The first `prompt_width` columns are the prompt: rows that agree on them (the S samples of
    one prompt) run them once, and no vocabulary projection is spent on them."""
    width = max(1, min(prompt_width, input_ids.shape[1] - 1))
    logits = _answer_logits(model, input_ids, attention_mask, width)  # columns width-1 .. T-1
    logp = (
        torch.log_softmax(restrict(logits[:, :-1].float(), allowed, temperature), dim=-1)
        .gather(-1, input_ids[:, width:, None])
        .squeeze(-1)
    )
    if allowed is not None:  # prompt tokens lie outside the answer vocabulary; they are never scored
        logp = torch.where(torch.isfinite(logp), logp, torch.zeros_like(logp))
    return torch.cat([torch.zeros_like(input_ids[:, :width], dtype=logp.dtype), logp], 1)


def _answer_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, width: int) -> torch.Tensor:
    """The logits of columns width-1 .. T-1 (B, T-width+1, V); a prompt that several rows share
    runs once and its KV cache is copied to them."""
    positions = position_ids(attention_mask)
    if width > 1:
        prefix = torch.cat([input_ids[:, :width], attention_mask[:, :width]], 1)
        distinct, row_of = torch.unique(prefix, dim=0, return_inverse=True)
    if width == 1 or len(distinct) == len(input_ids):
        keep = input_ids.shape[1] - width + 1
        return model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, logits_to_keep=keep
        ).logits
    first = torch.empty(len(distinct), dtype=torch.long).scatter_(0, row_of, torch.arange(len(input_ids)))
    head = model(
        input_ids=input_ids[first, :width],
        attention_mask=attention_mask[first, :width],
        position_ids=positions[first, :width],
        use_cache=True,
        logits_to_keep=1,
    )
    tail = model(
        input_ids=input_ids[:, width:],
        attention_mask=attention_mask,
        position_ids=positions[:, width:],
        use_cache=True,
        **{CACHE: select_rows(cache_of(head), row_of)},
    )
    return torch.cat([head.logits[row_of], tail.logits], 1)


@torch.no_grad()
def greedy_eval(
    lm: LoadedModel, task: Task, problems: Sequence[Problem] | None = None, batch_size: int = 256
) -> dict:
    """Held-out metric: `error`, the fraction of problems whose greedy answer is wrong; for tasks
    that can tell an unreadable answer from a wrong one (`is_well_formed`), also `format_error`,
    the fraction of answers that state no answer at all."""
    problems = list(task.eval_problems() if problems is None else problems)
    wrong = malformed = 0
    well_formed = getattr(task, "is_well_formed", None)
    for start in range(0, len(problems), batch_size):
        chunk = problems[start : start + batch_size]
        batch = rollout(lm, task, chunk, greedy=True)
        wrong += sum(not task.is_correct(p, a) for p, a in zip(chunk, batch.answers))
        malformed += sum(not well_formed(a) for a in batch.answers) if well_formed else 0
    n = max(len(problems), 1)
    return {"error": wrong / n} | ({"format_error": malformed / n} if well_formed else {})


def greedy_error(
    lm: LoadedModel, task: Task, problems: Sequence[Problem] | None = None, batch_size: int = 256
) -> float:
    return greedy_eval(lm, task, problems, batch_size)["error"]
