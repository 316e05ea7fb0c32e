import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import torch

from fedrl.strategies.checkpoint import Checkpointer, load_checkpoints, load_latest


def test_background_save_and_verified_load(tmp_path):
    ck = Checkpointer(tmp_path, keep=2)
    for v in range(4):
        ck.save_async(v, {"w": torch.full((4,), float(v))}, {"v": v})
    ck.flush()
    version, tensors, meta = load_latest(tmp_path)
    assert version == 3 and torch.equal(tensors["w"], torch.full((4,), 3.0)) and meta == {"v": 3}
    assert len(list(tmp_path.glob("ckpt-*.json"))) <= 2


def test_corrupt_newest_checkpoint_falls_back_to_the_previous(tmp_path):
    ck = Checkpointer(tmp_path, keep=3)
    ck.write(1, {"w": torch.ones(3)}, {})
    path = ck.write(2, {"w": torch.zeros(3)}, {})
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert load_latest(tmp_path)[0] == 1
    assert load_latest(tmp_path / "missing") is None
    manifest = json.loads((tmp_path / "ckpt-00000001.json").read_text())
    del manifest["sha256"]
    (tmp_path / "ckpt-00000001.json").write_text(json.dumps(manifest))
    skipped = []
    assert list(load_checkpoints(tmp_path, skipped)) == []
    assert skipped == [
        "ckpt-00000002.json: ckpt-00000002.safetensors does not match the SHA-256 its manifest records",
        "ckpt-00000001.json: its manifest lacks 'sha256'",
    ]


def test_killed_coordinator_restarts_from_its_checkpoint(tmp_path):
    """A real coordinator process (clients inline through a fake Grid) is killed with SIGKILL
    mid-run; a new process resumes from the last good checkpoint, no temp files remain."""
    script = tmp_path / "coord.py"
    script.write_text(
        textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from flwr.supercore.task_identity import TaskIdentity
        TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0
        from fake_grid import FakeGrid
        from fedrl.clients.client_app import app
        from fedrl.strategies.coordinator import run_coordinator
        from fedrl.strategies.run_config import RunConfig
        cfg = RunConfig(versions=int(sys.argv[1]), base_steps=2, max_steps=2, prompts=4, samples=4,
                        min_nodes=2, eval_every=1000, buffer_size=1, out_dir={str(tmp_path / "run")!r},
                        task_params=json.dumps({{"length": 8, "num_eval": 16}}))
        s = run_coordinator(FakeGrid(2, app), cfg)
        print("VERSIONS", s["versions"], [e for e in s["events"] if e["kind"] == "resumed"])
    """)
    )
    ckpt_dir = tmp_path / "run" / "checkpoints"
    proc = subprocess.Popen(
        [sys.executable, str(script), "1000"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and len(list(ckpt_dir.glob("ckpt-*.json"))) < 2:
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    saved, _, _ = load_latest(ckpt_dir)
    assert saved >= 1
    out = subprocess.run(
        [sys.executable, str(script), str(saved + 2)], capture_output=True, text=True, timeout=300
    )
    line = [x for x in out.stdout.splitlines() if x.startswith("VERSIONS")][-1]
    assert f"'from_version': {saved}" in line, out.stdout + out.stderr[-2000:]
    assert int(line.split()[1]) >= saved + 2
    assert not list(ckpt_dir.glob("*.tmp"))
    for manifest in ckpt_dir.glob("ckpt-*.json"):
        json.loads(manifest.read_text())  # every manifest left is whole


def test_leftovers_of_a_write_killed_midway_are_removed_at_start_up(tmp_path):
    from fedrl.strategies.checkpoint import Checkpointer, load_latest

    ck = Checkpointer(tmp_path)
    ck.write(3, {"w": torch.ones(2)}, {})
    ck.close()
    (tmp_path / "ckpt-00000004.safetensors.tmp").write_bytes(b"half a tensor file")
    (tmp_path / "ckpt-00000004.safetensors").write_bytes(b"whole, but its manifest never came")
    (tmp_path / "ckpt-00000004.json.tmp").write_bytes(b"{")
    (tmp_path / "notes.txt").write_text("not ours")
    Checkpointer(tmp_path).close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-00000003.json",
        "ckpt-00000003.safetensors",
        "notes.txt",
    ]
    assert load_latest(tmp_path)[0] == 3
