import psutil
import pytest

from fedrl.sim.kill_loop import LOG, kill_loop, run_to_end, warm_lives


def forkservers() -> list[psutil.Process]:
    def is_forkserver(proc: psutil.Process) -> bool:
        try:
            return "multiprocessing.forkserver" in " ".join(proc.cmdline())
        except psutil.NoSuchProcess:  # a child that ended meanwhile
            return False

    return [p for p in psutil.Process().children() if is_forkserver(p)]


def test_a_life_that_fails_on_its_own_stops_the_loop_with_its_reason(tmp_path):
    """A life that exits with an error (here the run config's, before any work) is no kill: the
    loop stops at once with the command's own message, from the log the lives write to, and
    does not go on to kill or rerun a run that cannot start. The warm process the lives are
    forked from goes with the block that used it."""
    bad = {"no_such_key": 1}
    run_dir = tmp_path / "killed"
    with warm_lives():
        with pytest.raises(RuntimeError, match="exited with 2") as failure:
            kill_loop(run_dir, kills=3, clients=2, overrides=bad, life_timeout_s=120)
        assert "no_such_key: Extra inputs are not permitted" in str(failure.value)
        assert (run_dir / LOG).read_text().count("--- a life of the run") == 1
        with pytest.raises(RuntimeError, match="no_such_key: Extra inputs are not permitted"):
            run_to_end(tmp_path / "unkilled", clients=2, overrides=bad, timeout_s=120)
        assert len(forkservers()) == 1
    assert forkservers() == []
