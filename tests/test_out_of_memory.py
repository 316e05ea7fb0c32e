"""A node that runs out of memory retries the step once with half the prompts, keeps to that
from then on, and says so in its reply; a second failure in a round is an error reply, and
the coordinator goes on. The allocator's own failure (RLIMIT_DATA, as a volunteer's
--max-memory sets it) is recognised as out of memory."""

import subprocess
import sys

import pytest
from fake_grid import FakeGrid, small_config

from fedrl.clients import block_worker
from fedrl.clients.block_worker import is_out_of_memory
from fedrl.clients.client_app import app as client_app
from fedrl.strategies.coordinator import run_coordinator

SAMPLES = 4
# what torch's CPU allocator raises when the kernel refuses it memory (a real one: see the last test)
CPU_ALLOCATOR = (
    "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
    "you tried to allocate 3221225472 bytes. Error code 12 (Cannot allocate memory)"
)


class TightMemory:
    """lm_update on a machine where a step of more than `fits` prompts does not fit, and the
    first `also_at_fits` steps of `fits` prompts do not either."""

    def __init__(self, fits: int, also_at_fits: int = 0):
        self.fits, self.also_at_fits, self.tried = fits, also_at_fits, []
        self.real = block_worker.lm_update

    def __call__(self, learner, model, batch):
        prompts = batch.input_ids.shape[0] // SAMPLES
        self.tried.append(prompts)
        if prompts > self.fits:
            raise RuntimeError(CPU_ALLOCATOR)
        if prompts == self.fits and self.also_at_fits:
            self.also_at_fits -= 1
            raise RuntimeError(CPU_ALLOCATOR)
        return self.real(learner, model, batch)


def replies(summary) -> list[dict]:
    return [e for e in summary["events"] if e["kind"] == "reply" and e["steps"] > 0]


def test_a_node_out_of_memory_halves_its_prompts_once_and_keeps_to_them(tmp_path, monkeypatch):
    tight = TightMemory(fits=2)
    monkeypatch.setattr(block_worker, "lm_update", tight)
    cfg = small_config(tmp_path, prompts=4, samples=SAMPLES, versions=4)
    summary = run_coordinator(FakeGrid(3, client_app), cfg)
    assert summary["versions"] >= 4 and summary["counts"]["errors"] == 0, summary["counts"]
    # each node tried 4 prompts once; every later step of every round took 2
    assert tight.tried.count(4) == 3 and tight.tried.count(2) >= 3 * 4, tight.tried
    assert {e["prompts"] for e in replies(summary)} == {2}
    assert all(c.get("prompts") == 2 for c in summary["clients"].values()), summary["clients"]


def test_the_coordinator_measures_an_upload_by_the_steps_behind_it_not_by_its_samples(tmp_path, monkeypatch):
    """A node at half the prompts took as many steps on half the samples: the clip measures its
    upload by its steps (it counted half of them when it divided its samples by the run's batch)."""
    monkeypatch.setattr(block_worker, "lm_update", TightMemory(fits=2))
    cfg = small_config(tmp_path, mode="block-sequential", sync=True, prompts=4, samples=SAMPLES, versions=3)
    summary = run_coordinator(FakeGrid(3, client_app), cfg)
    trained = {}
    for e in summary["events"]:
        if e["kind"] == "reply":
            trained[e["node"]] = e["steps"]
        elif e["kind"] == "accepted":  # block rounds upload what the reply before it trained
            assert e["steps"] == trained[e["node"]], (e, trained)
    assert any(e["kind"] == "accepted" and e["steps"] >= 2 for e in summary["events"])


def test_a_second_failure_in_a_round_is_an_error_reply_and_the_run_goes_on(tmp_path, monkeypatch):
    tight = TightMemory(fits=2, also_at_fits=1)  # the first retry fails too
    monkeypatch.setattr(block_worker, "lm_update", tight)
    cfg = small_config(tmp_path, prompts=4, samples=SAMPLES, versions=3)
    summary = run_coordinator(FakeGrid(3, client_app), cfg)
    errors = [e for e in summary["events"] if e["kind"] == "error"]
    assert len(errors) == 1 and "can't allocate memory" in errors[0]["reason"], errors
    assert summary["versions"] >= 3
    # the failed node kept no cap (its round raised): it tried 4 again, then went down to 2
    assert tight.tried.count(4) == 4, tight.tried
    assert {e["prompts"] for e in replies(summary)} == {2}


def test_a_step_that_fails_for_another_reason_is_not_retried(tmp_path, monkeypatch):
    tried = []

    def broken(learner, model, batch):
        tried.append(batch.input_ids.shape[0])
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    monkeypatch.setattr(block_worker, "lm_update", broken)
    cfg = small_config(tmp_path, prompts=4, samples=SAMPLES, versions=1, stall_replies=3)
    summary = run_coordinator(FakeGrid(3, client_app), cfg)
    assert summary["counts"]["errors"] >= 3 and set(tried) == {4 * SAMPLES}


@pytest.mark.parametrize(
    "err,out_of_memory",
    [
        (MemoryError(), True),
        (RuntimeError(CPU_ALLOCATOR), True),
        (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), False),
        (ValueError("can't allocate memory"), False),
    ],
)
def test_what_counts_as_out_of_memory(err, out_of_memory):
    assert is_out_of_memory(err) is out_of_memory


def test_the_cpu_allocators_real_failure_under_a_memory_cap_counts():
    code = """
import resource, torch
from fedrl.clients.block_worker import is_out_of_memory
used = int(next(l.split()[1] for l in open("/proc/self/status") if l.startswith("VmData:"))) * 1024
resource.setrlimit(resource.RLIMIT_DATA, (used + 2**28, resource.RLIM_INFINITY))
try:
    torch.ones(2**30)  # 4 GiB of float32, past the cap
except Exception as err:
    print(type(err).__name__, is_out_of_memory(err))
"""
    if not sys.platform.startswith("linux"):
        pytest.skip("RLIMIT_DATA caps mmap'd memory on Linux")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["RuntimeError", "True"], out.stdout + out.stderr
