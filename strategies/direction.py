"""A direction check for untrusted updates: does a client's update point where the answers are?

An update reversed at its own size, or at the clip's bound, passes every norm check, and one
such update moves a probe's greedy reward by less than the probe's own noise. What gives it
away is its direction, over several rounds. The coordinator holds the task's reference answers:
the gradient of their mean log-prob on a fixed probe set, at the current global state and for
the block an update changes, is a direction no client can steer (a reference made of client
updates, such as their median or momentum, is steered by the attackers in it). One update's
cosine with it is small (honest DG updates on the tiny model: about +0.03, spread 0.06; their
sampling noise dominates them), but its sign persists: a client that reverses its updates sits
below zero round after round. So each client accumulates evidence: its cosines so far, each
less the bar when it came, summed (S, in units of sigma: a robust spread of every client's
recent cosines). Two tests read it (`test`):
- "z" (the default): z = S / sqrt(n), refused (cause `direction`) while z < -threshold. An
  honest client's z drifts up with n; a reversing one's down. Re-tested at every update with no
  correction, it refuses a client whose mean sits at the bar sooner or later for sure (the law
  of the iterated logarithm): in short runs about 1 in 4 at a mean of 0 over 12 updates. It is
  the default because those eager refusals also catch buggy clients early, and DG's federated
  runs with buggy volunteers lean on that (README, Chaos: "a sequential test").
- "sequential": the likelihood ratio of "it leans away by d spreads" against "it sits at the
  bar", ln LR_d = -d S - n d^2 / 2, averaged over a few d (ATTACKER_EFFECTS), refused while at
  least 1 / `false_refusal`. Under "at the bar" the ratio is a nonnegative martingale, so
  (Ville's inequality) an honest client at the bar is ever refused with a chance of at most
  `false_refusal` however long it runs, and less the further it leans toward the answers. The
  price is evidence: an attacker at -0.75 spreads is refused after about 12 updates instead of 3.

The bar is 0, unless most recent updates lean away (their median m < 0): then it is 2m, so
that a client at the federation's lean is judged as one at a lean of |m| toward the answers
would be. From a random start, at some states every honest loss's updates lean away from the
reference answers (PPO's and DG's alike, measured on the tiny model: mean cosines down to
-0.2), and a bar at 0 refused honest clients by the hundred and zero-weighted most of the
rest. A lean that the federation shares is no evidence against one client (a bar at m itself
would refuse an honest client at m one check in 15 under the z-test: its z would hover at 0); a
client far below it still stands out, and a minority of attackers cannot move the median far.

Every accepted update is also weighted by its own cosine, max(cos - bar, 0), as FLTrust weights
updates by their cosine with a server update made on trusted data; this acts from a client's
first update, where the refusal needs evidence first. A reversed update gets weight only when
the honest update it reverses leaned away from the answers, and then it leans toward them; with
updates clipped to the median norm (the default `clip-multiple = 1`) a flipper gains nothing by
size either.
"""

from __future__ import annotations

import collections
import math
import statistics
import time
from collections.abc import Mapping

import numpy as np
import torch

from fedrl.lora import AdapterModel
from fedrl.rollout import answer_vocab, left_pad, token_logprobs
from fedrl.strategies.aggregation import update_norm
from fedrl.strategies.run_config import check_direction
from fedrl.tasks.base import Task

PROBE_SEED = 0xD1EC  # the probe problems' stream, apart from the gate's, every client's and the eval's
SPREAD_WINDOW = 256  # recent cosines (every client's) that sigma is measured on
MIN_SPREAD = 8  # cosines needed before sigma means anything: nothing is refused before
# how far below the bar (in spreads of the recent cosines) the refusal looks for a client's mean:
# near the honest noise (0.5), and farther, for attackers it then refuses on fewer updates
ATTACKER_EFFECTS = (0.5, 1.0, 2.0)


def rest_rounds(refusals_in_a_row: int, cap: int) -> int:
    """How many of its own rounds a client sits out after its `refusals_in_a_row`-th update in a
    row refused by the direction check: 1, 2, 4, ... up to `cap` (0: it never rests). Its record
    moves only with new updates, so a refused client would be refused round after round, its
    samples spent for nothing; doubling rests probe it less and less often, as BOINC cuts the
    quota of a host whose results fail, and one accepted update ends the streak."""
    if cap <= 0 or refusals_in_a_row <= 0:
        return 0
    return min(2 ** (refusals_in_a_row - 1), cap)


class NoTextAnswers(ValueError):
    """The task's targets are not answers the check can score (the digits bandit's are actions):
    the coordinator runs without the check, and says so, rather than fail."""


def reference_answers_batch(adapter: AdapterModel, task: Task, problems) -> dict:
    """Prompts with their reference answers (the text `str(target)` and <eos>, cut to the answer
    length the task allows, as a sampled answer is), teacher-forced:
    the tensors token_logprobs scores. Refuses a task whose target is not an answer it accepts
    (the digits bandit's targets are actions, not text)."""
    lm = adapter.lm
    wrong = [p for p in problems if not isinstance(p.prompt, str) or not task.is_correct(p, str(p.target))]
    if wrong:
        raise NoTextAnswers(
            f"task {task.name!r}: the direction check needs text prompts whose targets, written "
            "as text, are correct answers"
        )
    prompts = [lm.prompt_ids(p.prompt, task.chat) for p in problems]
    prompt_ids, prompt_mask = left_pad(prompts, lm.pad_token_id)
    answers = [lm.answer_ids(str(p.target))[: task.max_answer_tokens] for p in problems]
    width = max(len(a) for a in answers)
    answer_ids = torch.full((len(problems), width), lm.pad_token_id, dtype=torch.long)
    answer_mask = torch.zeros((len(problems), width), dtype=torch.long)
    for i, a in enumerate(answers):
        answer_ids[i, : len(a)] = torch.as_tensor(a)
        answer_mask[i, : len(a)] = 1
    return {
        "input_ids": torch.cat([prompt_ids, answer_ids], 1),
        "attention_mask": torch.cat([prompt_mask, answer_mask], 1),
        "answer_mask": torch.cat([torch.zeros_like(prompt_mask), answer_mask], 1).float(),
        "prompt_width": prompt_ids.shape[1],
        "allowed": answer_vocab(lm, task),
    }


def z_evidence(count: int, total: float, sigma: float) -> float:
    """z of a client's `count` cosines (summing to `total`) against zero: mean * sqrt(n) / sigma."""
    return total / count * count**0.5 / sigma


def likelihood_evidence(count: int, total: float, sigma: float) -> float:
    """ln of the likelihood ratio, averaged over ATTACKER_EFFECTS, that a client's `count`
    cosines (summing to `total`, each less its bar) lean away by d spreads `sigma` rather than
    sit at the bar, both normal with spread sigma: ln LR_d = -d * total / sigma - count * d^2 / 2.
    Above 0 they lean away; the sequential test refuses from ln(1 / false_refusal)."""
    logs = [-d * total / sigma - count * d * d / 2 for d in ATTACKER_EFFECTS]
    top = max(logs)
    return top + math.log(sum(math.exp(x - top) for x in logs) / len(logs))


def robust_spread(values) -> float:
    """1.4826 x the median absolute deviation: the standard deviation for a normal sample, and
    a minority of attackers far off does not inflate it."""
    median = statistics.median(values)
    return 1.4826 * statistics.median(abs(v - median) for v in values)


class DirectionCheck:
    def __init__(
        self,
        adapter: AdapterModel,
        task: Task,
        problems: int,
        seed: int,
        weighting: str = "none",
        test: str = "z",
        threshold: float = 1.5,
        false_refusal: float = 0.05,
    ):
        check_direction(test, false_refusal, weighting)
        self.adapter, self.weighting, self.test, self.threshold = adapter, weighting, test, threshold
        self.bound = math.log(1 / false_refusal)  # the ln likelihood ratio the sequential test refuses from
        probe = task.sample(problems, np.random.default_rng([seed, PROBE_SEED]))
        self.batch = reference_answers_batch(adapter, task, probe)
        self.cached: tuple[int, dict[tuple[str, ...], dict[str, torch.Tensor]]] = (-1, {})
        # client id -> (updates, sum of their cosines less the bar when each came): a checkpoint
        # of before the bar (always 0 then) holds the same sums
        self.records: dict[int, tuple[int, float]] = {}
        self.recent: collections.deque = collections.deque(maxlen=SPREAD_WINDOW)
        self.cpu_s, self.computed = 0.0, 0  # what the reference directions cost

    def log_prob(self, state: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The probe's mean log-prob of its reference answer tokens under `state` (differentiable
        in the parameters that require grad)."""
        model, b = self.adapter.lm.model, self.batch
        self.adapter.part.set_all(model, state)
        logp = token_logprobs(model, b["input_ids"], b["attention_mask"], b["allowed"], b["prompt_width"])
        return (logp * b["answer_mask"]).sum() / b["answer_mask"].sum()

    def reference(self, version: int, state: Mapping[str, torch.Tensor], names: list[str]) -> dict:
        """The gradient of log_prob w.r.t. `names` under `state`, once per version and block."""
        if self.cached[0] != version:  # every block's direction of the last version asked for
            self.cached = (version, {})
        key = tuple(names)
        if key not in self.cached[1]:
            cpu = time.process_time()
            params = dict(self.adapter.lm.model.named_parameters())
            wanted = [params[n] for n in names]
            flags = {n: p.requires_grad for n, p in params.items()}
            try:
                for p in params.values():
                    p.requires_grad_(False)
                for p in wanted:
                    p.requires_grad_(True)
                grads = torch.autograd.grad(self.log_prob(state), wanted)
            finally:
                for n, p in params.items():
                    p.requires_grad_(flags[n])
            self.cached[1][key] = {n: g.detach().float() for n, g in zip(names, grads)}
            self.cpu_s += time.process_time() - cpu
            self.computed += 1
        return self.cached[1][key]

    def check(
        self, client: int, version: int, state: Mapping[str, torch.Tensor], delta: Mapping[str, torch.Tensor]
    ) -> tuple[float, float | None, str | None]:
        """(the update's cosine with the reference, the client's evidence (its z, or its ln
        likelihood ratio under the sequential test) or None while there is too little to judge,
        why it is refused or None).
        The cosine joins the client's record whether or not the update is refused: refusing an
        attacker must not clear its name."""
        names = sorted(delta)
        ref = self.reference(version, state, names)
        dot = sum(float((ref[n] * delta[n].float()).sum()) for n in names)
        norms = update_norm(ref) * update_norm(delta)
        if norms == 0:  # no direction to judge (an update, or a reference, of zeros): no record, no spread
            return 0.0, None, None
        cosine = dot / norms
        self.recent.append(cosine)
        count, excess = self.records.get(client, (0, 0.0))
        count, excess = count + 1, excess + cosine - self.bar()  # each against the bar of its time
        self.records[client] = (count, excess)
        if len(self.recent) < MIN_SPREAD:
            return cosine, None, None
        sigma = robust_spread(self.recent)
        if sigma <= 0:
            return cosine, None, None
        if self.test == "z":
            value = z_evidence(count, excess, sigma)
            if value >= -self.threshold:
                return cosine, value, None
            why = f"(z {value:.2f} < -{self.threshold:g})"
        else:
            value = likelihood_evidence(count, excess, sigma)
            if value < self.bound:
                return cosine, value, None
            why = (
                f"(spread {sigma:.3f}): {math.exp(min(value, 700)):.3g} times likelier if they lean away "
                f"than at the bar (refused from {math.exp(self.bound):.3g})"
            )
        return (
            cosine,
            value,
            f"over its {count} update(s) this client's mean cosine with the probe's reference "
            f"direction, each against the bar of its time, is {excess / count:+.3f} {why}: its "
            "updates point away from the task's answers",
        )

    def bar(self) -> float:
        """What cosines are judged against: 0, or twice the recent median when it is below 0 (a
        lean the clients share, mirrored); 0 while too few cosines are known."""
        return 2 * min(0.0, statistics.median(self.recent)) if len(self.recent) >= MIN_SPREAD else 0.0

    def weight(self, cosine: float) -> float:
        """An accepted update's weight in its block's mean (times its other weights)."""
        if self.weighting == "cosine":
            return max(cosine - self.bar(), 0.0)
        return 1.0

    def state_dict(self) -> dict:
        return {"records": {str(k): list(v) for k, v in self.records.items()}, "recent": list(self.recent)}

    def load_state_dict(self, state: dict) -> None:
        # JSON turns int keys into strings
        self.records = {int(k): (int(n), float(t)) for k, (n, t) in state.get("records", {}).items()}
        self.recent.clear()
        self.recent.extend(float(c) for c in state.get("recent", []))
