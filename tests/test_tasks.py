import numpy as np
import pytest

from fedrl.tasks import AdditionTask, DigitsBandit, Problem, ReversalTask, error_rate, get_task
from fedrl.tasks.addition import stated_answer


def test_reversal_rewards_on_known_cases():
    task = ReversalTask(length=4, num_symbols=2)
    p = Problem("0011", "1100")
    assert task.reward(p, "1100") == 1.0
    assert task.reward(p, "1000") == 0.25  # right up to the first error only
    assert task.reward(p, "0100") == 0.0
    frac = ReversalTask(length=4, reward_kind="fraction")
    assert frac.reward(p, "1000") == 0.75
    exact = ReversalTask(length=4, kappa=0.0)
    assert exact.reward(p, "1101") == 0.0 and exact.reward(p, "1100") == 1.0
    assert task.is_correct(p, "1100") and not task.is_correct(p, "110")


def test_reversal_eval_set_is_all_prompts_for_the_paper_setting():
    problems = ReversalTask(length=10, num_symbols=2).eval_problems()
    assert len(problems) == 1024 and len({p.prompt for p in problems}) == 1024
    assert all(p.target == p.prompt[::-1] for p in problems)


@pytest.mark.parametrize("task", [ReversalTask(length=6, num_symbols=3), AdditionTask(), DigitsBandit()])
def test_sampling_is_deterministic_from_the_seed(task):
    a = task.sample(20, np.random.default_rng(7))
    b = task.sample(20, np.random.default_rng(7))
    c = task.sample(20, np.random.default_rng(8))
    key = lambda ps: [(str(np.asarray(p.prompt).tolist()), p.target) for p in ps]
    assert key(a) == key(b) and key(a) != key(c)
    assert key(task.eval_problems()) == key(task.eval_problems())


def test_addition_rewards_on_known_cases():
    task = AdditionTask()
    p = Problem("What is 23 + 45? Reply with only the number.", "68")
    assert task.reward(p, "68") == 1.0
    assert task.reward(p, "23 + 45 = 68") == 1.0
    assert task.reward(p, "The answer is 68.") == 1.0
    assert task.reward(p, "23 + 45 = 58") == 0.0
    assert task.reward(p, "sixty-eight") == 0.0
    assert stated_answer("1,234") == 1234
    # a wrong sum is still a well-formed answer; an answer with no number in it is a format error
    assert task.is_well_formed("23 + 45 = 58") and task.is_well_formed("68")
    assert not task.is_well_formed("sixty-eight") and not task.is_well_formed("")
    assert all(
        int(q.target) == sum(map(int, q.prompt.split("?")[0].split()[2::2])) for q in task.eval_problems()
    )


def test_digits_bandit_reward_and_split():
    task = DigitsBandit()
    x, y = task.eval_arrays()
    assert x.shape[1] == 64 and 0 <= x.min() and x.max() <= 1
    p = Problem(x[0], int(y[0]))
    assert task.reward(p, int(y[0])) == 1.0 and task.reward(p, (int(y[0]) + 1) % 10) == 0.0
    part = task.client_split(5, 2)
    _, labels = part.sample_arrays(500, np.random.default_rng(0))
    assert set(labels.tolist()) <= set(part.classes) and len(part.classes) < 10


def test_non_iid_splits_differ_across_clients():
    base = ReversalTask(length=8)
    first, last = base.client_split(4, 0), base.client_split(4, 3)
    rng = np.random.default_rng(0)
    ones = lambda t: np.mean([c == "1" for p in t.sample(400, rng) for c in p.prompt])
    assert ones(last) < 0.4 < 0.6 < ones(first)
    adds = [AdditionTask().client_split(3, i) for i in range(3)]
    assert adds[0].high < adds[1].low and adds[1].high < adds[2].low
    with pytest.raises(ValueError):
        base.client_split(4, 4)


def test_error_rate_and_bad_task_params():
    task = get_task("reversal", length=2)
    probs = [Problem("01", "10"), Problem("11", "11")]
    assert error_rate(task, probs, ["10", "10"]) == 0.5
    with pytest.raises(ValueError, match="unknown task"):
        get_task("chess")
    with pytest.raises(ValueError, match="bad parameters"):
        get_task("reversal", colour="red")
    with pytest.raises(ValueError, match="num_symbols"):
        get_task("reversal", num_symbols=11)
