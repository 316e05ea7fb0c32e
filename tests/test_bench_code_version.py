"""Which code a benchmark's JSON was made by (`fedrl.bench.common.code_version`)."""

import subprocess
from pathlib import Path

import pytest

import fedrl
from fedrl.bench.common import code_version

REPO = Path(fedrl.__file__).resolve().parent.parent


def test_a_checkout_names_its_commit_and_says_when_tracked_files_changed():
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    changed = subprocess.run(
        ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    expected = head.stdout.strip() + ("+dirty" if changed else "")
    assert code_version() == {"version": fedrl.__version__, "commit": expected}
