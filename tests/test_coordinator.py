import json
import statistics
import time

import pytest
import torch
from fake_grid import FakeGrid, at_protocol, report_of, small_config, with_report
from flwr.app import ConfigRecord, Error, Message, RecordDict

from fedrl.clients.client_app import app as client_app
from fedrl.clients.client_app import load_state
from fedrl.strategies.coordinator import run_coordinator


@pytest.fixture(autouse=True)
def task_identity():
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0


def config(tmp_path, **kw):
    return small_config(tmp_path, **kw)


@pytest.mark.parametrize(
    "mode,sync",
    [("parablock", False), ("parablock", True), ("block-sequential", True), ("fedavg-lora", True)],
)
def test_modes_reach_their_versions(tmp_path, mode, sync):
    summary = run_coordinator(FakeGrid(3, client_app), config(tmp_path, mode=mode, sync=sync))
    assert summary["versions"] >= 3
    assert summary["counts"]["rejected"] == 0 and summary["counts"]["errors"] == 0
    assert summary["bytes_up"] > 0 and summary["bytes_down"] > 0
    # each eval records the bytes moved by then (patches and Flower messages): none before the
    # first round, all of them at the final one
    moved = [(e["bytes_up"], e["bytes_down"]) for e in summary["evals"]]
    up, down = zip(*moved)
    assert moved[0] == (0, 0) and list(up) == sorted(up) and list(down) == sorted(down)
    assert moved[-1] == (
        summary["bytes_up"] + summary["control_bytes_up"],
        summary["bytes_down"] + summary["control_bytes_down"],
    )
    assert (tmp_path / "run" / "adapter" / "adapter_config.json").exists()
    overlap = sum(c["overlap_s"] for c in summary["clients"].values())
    if mode == "parablock":
        assert overlap > 0  # communication ran while the compute thread trained
    else:
        assert overlap == 0  # download, compute, upload: one after another


def test_dropouts_error_replies_and_malformed_replies_are_events_not_crashes(tmp_path):
    def script(node, msg, reply):
        if node == 3:  # gone: what the SuperLink synthesizes for an unavailable node
            return Message(Error(code=5, reason="node unavailable"), reply_to=msg)
        if node == 2 and msg.content["instruction"]["version"] == 1:
            return Message(RecordDict({"junk": ConfigRecord({"x": 1})}), reply_to=msg)
        return reply

    summary = run_coordinator(
        FakeGrid(3, client_app, script), config(tmp_path, mode="block-sequential", sync=True)
    )
    assert summary["versions"] >= 3
    assert summary["counts"]["errors"] >= 3
    reasons = [e["reason"] for e in summary["events"] if e["kind"] == "rejected"]
    assert any("malformed reply" in r for r in reasons)


def test_nan_stale_and_misattributed_updates_are_rejected(tmp_path):
    from fedrl.patch import encode_patch
    from fedrl.store_client import BlockingStoreClient

    grid = None
    keys = {}

    def script(node, msg, reply):
        if reply.has_error():
            return reply
        instr, report = msg.content["instruction"], report_of(reply)
        keys.setdefault(node, []).append(report["upload_key"])
        if node == 1:  # NaN: upload a poisoned patch of its block under its own credential
            held = grid.held(1)
            block_names = [n for n in held if f".layers.{report['upload_block']}." in n]
            base = {n: held[n] for n in block_names}
            poisoned = {n: t.clone() for n, t in base.items()}
            next(iter(poisoned.values())).view(-1)[0] = float("nan")
            store = BlockingStoreClient(instr["store_url"], instr["principal"], instr["token"])
            key = store.put(
                encode_patch(base, poisoned, report["upload_base_version"], report["upload_base_version"])
            )
            store.close()
            return with_report(msg, reply, upload_key=key)
        if node == 2:  # claims an upload of node 3's
            return with_report(msg, reply, upload_key=keys.get(3, [report["upload_key"]])[-1])
        if node == 3 and instr["version"] >= 1:  # claims to be based on a version far in the past
            return with_report(msg, reply, upload_base_version=0)
        return reply

    grid = FakeGrid(3, client_app, script)
    cfg = config(
        tmp_path,
        mode="block-sequential",
        sync=True,
        num_blocks=3,
        max_staleness=0,
        versions=3,
        stall_replies=9,
    )
    summary = run_coordinator(grid, cfg)
    assert any(e["kind"] == "stopped" for e in summary["events"])  # nothing honest left: it stops, not spins
    reasons = {e["node"]: e["reason"] for e in summary["events"] if e["kind"] == "rejected"}
    assert "non-finite" in reasons[1]
    assert "uploaded by" in reasons[2] or "404" in reasons[2]
    assert "staleness" in reasons[3] or "retained" in reasons[3]
    assert summary["counts"]["accepted"] >= 1  # node 3's first, honest update


def test_resume_continues_from_the_checkpoint(tmp_path):
    cfg = config(tmp_path, versions=2, eval_every=1)
    first = run_coordinator(FakeGrid(3, client_app), cfg)
    assert first["versions"] >= 2
    # the same command again: before, it went on for no version and overwrote the summary with
    # 0 rounds and 0 bytes
    summary = (tmp_path / "run" / "summary.json").read_bytes()
    with pytest.raises(
        ValueError, match=f"finished at v{first['versions']}, and versions=2 asks for no more"
    ):
        run_coordinator(FakeGrid(3, client_app), cfg)
    assert (tmp_path / "run" / "summary.json").read_bytes() == summary
    second = run_coordinator(FakeGrid(3, client_app), cfg.replace(versions=4))
    resumed = [e for e in second["events"] if e["kind"] == "resumed"]
    assert resumed and resumed[0]["from_version"] == first["versions"]
    assert second["versions"] >= 4
    # the resumed life counts from the run's start: its evals go on from the first life's (time,
    # bytes), and the summary's totals hold both lives (before, each restarted from 0)
    evals = second["evals"]
    carried = [e for e in evals if e["version"] <= first["versions"]]  # from the checkpoint
    assert 2 <= len(carried) < len(evals)
    for key in ("t", "wall_s", "bytes_up", "bytes_down"):
        assert all(a[key] <= b[key] for a, b in zip(evals, evals[1:])), key
    assert resumed[0]["t"] >= carried[-1]["t"]
    assert second["rounds"] > first["rounds"] and second["bytes_up"] > first["bytes_up"]
    assert second["time_s"] > first["time_s"]
    # the best-evaluated adapter is the best over both lives' evals
    assert (second["best_adapter"]["error"], second["best_adapter"]["version"]) == best_of(evals)
    # so does each node's ledger: both lives' merged uploads, per node (the events file has both)
    for node, row in second["ledger"].items():
        lives = [first, second]
        merged = sum(e["kind"] == "accepted" and str(e["node"]) == node for s in lives for e in s["events"])
        assert row["accepted"] == merged and row["accepted"] > first["ledger"][node]["accepted"], node


def test_a_checkpoint_made_with_other_settings_is_refused_before_nodes_are_awaited_and_kept(tmp_path):
    """Before: a run resumed with another lora_rank took the old tensors (their names matched)
    and failed 46 s into `fedrl sim`, in a client, with a bare shape error; one with another seed
    or model of the same shapes went on, from an adapter made for another base."""
    cfg = config(tmp_path, versions=2)
    run_coordinator(FakeGrid(3, client_app), cfg)
    folder = tmp_path / "run" / "checkpoints"
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    # no node ever connects: each refusal comes before the wait for them, which would time out

    def resume(**changes):
        run_coordinator(FakeGrid(0, client_app), cfg.replace(node_wait_s=0.5, **changes))

    for changes, reason in (
        ({"lora_rank": 4}, "made with lora_rank=8"),
        ({"seed": 1}, "made with seed=0"),
        ({"model": "tiny-gpt", "lora_alpha": 8.0}, "made with model='tiny-base', lora_alpha=16.0"),
    ):
        with pytest.raises(
            ValueError, match=f"checkpoint v\\d+ in .* does not fit this run \\({reason}\\): run with"
        ):
            resume(**changes)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    # the same task parameters written otherwise are the same: refused only for asking no more versions
    with pytest.raises(ValueError, match="asks for no more"):
        resume(task_params=json.dumps(json.loads(cfg.task_params), indent=2, sort_keys=True))
    # a checkpoint that does not say its settings is judged by its tensors
    for manifest in folder.glob("ckpt-*.json"):
        record = json.loads(manifest.read_text())
        del record["meta"]["config"]
        manifest.write_text(json.dumps(record))
    with pytest.raises(ValueError, match="does not fit this run \\(.*lora_A.*has shape \\(8, "):
        resume(lora_rank=4)


def test_a_resumed_coordinator_keeps_older_checkpoints_as_bases(tmp_path):
    """A client may hold a delta computed on a version before the newest checkpoint: after a
    restart that base is still known (the delta is judged, not refused as "no longer retained")
    and a client holding it syncs with one small patch."""
    from fedrl.patch import state_hash
    from fedrl.strategies.checkpoint import load_checkpoints
    from fedrl.strategies.coordinator import Coordinator

    cfg = config(tmp_path, versions=3, max_staleness=2)
    run_coordinator(FakeGrid(3, client_app), cfg)
    kept = {v: t for v, t, _ in load_checkpoints(tmp_path / "run" / "checkpoints")}
    assert len(kept) == 3  # max_staleness + 1 checkpoints survive
    latest = max(kept)
    with Coordinator(FakeGrid(3, client_app), cfg.replace(versions=latest + 2)) as again:
        assert again.resume() and again.version == latest
        for v in (latest - 2, latest - 1):  # as published: cast to the wire dtype
            assert state_hash(again.publisher.state(v)) == state_hash(again.wire(kept[v]))
    with Coordinator(
        FakeGrid(3, client_app), cfg.replace(versions=latest + 2, max_staleness=latest)
    ) as again:
        assert again.resume()  # v0 has no checkpoint: the coordinator's seeded build stands for it
        assert state_hash(again.publisher.state(0)) == state_hash(again.wire(again.adapter.initial))
        again.publish()
        assert any(r["base_version"] == latest - 1 and r["target_version"] == latest for r in again.refs)
    # the newest checkpoint damaged on disk: the resume goes on from the one before and says why
    newest = tmp_path / "run" / "checkpoints" / f"ckpt-{latest:08d}.safetensors"
    newest.write_bytes(newest.read_bytes()[:-1] + b"!")
    with Coordinator(FakeGrid(3, client_app), cfg.replace(versions=latest + 2)) as again:
        assert again.resume() and again.version == latest - 1
        skipped = [e["reason"] for e in again.log.events if e["kind"] == "checkpoint-skipped"]
        assert skipped == [
            f"ckpt-{latest:08d}.json: {newest.name} does not match the SHA-256 its manifest records"
        ]


def test_exported_adapter_loads_with_peft_and_reproduces_the_final_eval(tmp_path):
    from peft import PeftModel

    from fedrl.models import load_model
    from fedrl.rollout import greedy_error
    from fedrl.tasks import get_task

    cfg = config(tmp_path, versions=2, eval_every=1)
    summary = run_coordinator(FakeGrid(3, client_app), cfg)
    task = get_task("reversal", **json.loads(cfg.task_params))
    lm = load_model("tiny-base")
    lm.model = PeftModel.from_pretrained(lm.model, summary["adapter_dir"]).eval()
    assert greedy_error(lm, task) == summary["final_eval"]
    # beside it, the version that evaluated best (the earliest of equals), which reproduces its error
    best = summary["best_adapter"]
    assert (best["error"], best["version"]) == best_of(summary["evals"])
    lm = load_model("tiny-base")
    lm.model = PeftModel.from_pretrained(lm.model, best["adapter_dir"]).eval()
    assert greedy_error(lm, task) == best["error"]


def best_of(evals: list[dict]) -> tuple[float, int]:
    error = min(e["error"] for e in evals)
    return error, next(e["version"] for e in evals if e["error"] == error)


def test_a_second_run_in_the_same_process_starts_from_the_fresh_adapter(tmp_path):
    """Clients in this process share their model cache; the coordinator owns its own model,
    so a new run does not inherit the weights the previous one trained: the v0 it names to the
    nodes (the hash of its starting state) is the first run's. (The held-out error of a two-version
    run need not move, so the weights' hash, not the eval, tells.)"""

    class Grid(FakeGrid):
        def __init__(self):
            super().__init__(3, client_app)
            self.origins = set()

        def reply_to(self, node, msg):
            if "settings" in msg.content.config_records:
                self.origins.add(msg.content["settings"]["origin_hash"])
            return super().reply_to(node, msg)

    first_grid, second_grid = Grid(), Grid()
    first = run_coordinator(first_grid, config(tmp_path / "a", versions=2))
    assert first["versions"] >= 2 and first["counts"]["accepted"] > 0  # the weights it left moved
    second = run_coordinator(second_grid, config(tmp_path / "b", versions=1))
    assert len(first_grid.origins) == 1 and second_grid.origins == first_grid.origins
    assert second["initial_eval"] == first["initial_eval"]


def test_a_dishonest_node_with_a_valid_credential_cannot_crash_the_coordinator(tmp_path):
    """Three ways that crashed it: a whole-adapter upload in block mode, a block whose tensors
    have the wrong shapes (transposed; one element, which would broadcast), and a report of
    5e-324 s for one step (the scheduler's step count overflowed)."""
    from fedrl.patch import encode_patch
    from fedrl.store_client import BlockingStoreClient

    grid = None

    def upload(node, instr, tensors, base_version):
        store = BlockingStoreClient(instr["store_url"], instr["principal"], instr["token"])
        try:
            return store.put(encode_patch(None, tensors, None, base_version))
        finally:
            store.close()

    def script(node, msg, reply):
        if reply.has_error():
            return reply
        instr, report = msg.content["instruction"], report_of(reply)
        held = grid.held(node)
        base_version = report["upload_base_version"]
        if node == 1:  # the whole adapter, x100, reported as a whole-adapter upload in block mode
            key = upload(node, instr, {n: 100 * t for n, t in held.items()}, base_version)
            return with_report(msg, reply, upload_key=key, upload_block=-1)
        if node == 2:  # its block with every matrix transposed, or shrunk to one element
            names = [n for n in held if f".layers.{report['upload_block']}." in n]
            odd = {
                n: held[n].t().contiguous() if instr["version"] % 2 else held[n].reshape(-1)[:1]
                for n in names
            }
            return with_report(msg, reply, upload_key=upload(node, instr, odd, base_version))
        return with_report(msg, reply, compute_s=5e-324, steps=1)  # node 3: impossibly fast

    grid = FakeGrid(3, client_app, script)
    cfg = config(tmp_path, mode="block-sequential", sync=True, versions=3, stall_replies=12)
    summary = run_coordinator(grid, cfg)
    assert summary["versions"] >= 3  # node 3's updates are honest and keep the run going
    reasons = {}
    for e in summary["events"]:
        if e["kind"] == "rejected":
            reasons.setdefault(e["node"], []).append(e["reason"])
    assert all("whole-adapter upload" in r for r in reasons[1])
    assert reasons[2] and all("shape" in r for r in reasons[2])
    assert 3 not in reasons


def test_an_upload_that_would_decompress_far_beyond_its_block_is_refused_unopened(tmp_path):
    import struct

    import zstandard

    from fedrl.patch import FORMAT_VERSION
    from fedrl.store_client import BlockingStoreClient

    frame = zstandard.ZstdCompressor(level=3).compress(bytes(64 << 20))  # 64 MiB of zeros in a few KB
    bomb = struct.pack("<4sBQ", b"FRLP", FORMAT_VERSION, len(frame)) + frame

    def script(node, msg, reply):
        if reply.has_error() or node != 1:
            return reply
        instr = msg.content["instruction"]
        store = BlockingStoreClient(instr["store_url"], instr["principal"], instr["token"])
        try:
            return with_report(msg, reply, upload_key=store.put(bomb))
        finally:
            store.close()

    summary = run_coordinator(
        FakeGrid(3, client_app, script), config(tmp_path, mode="block-sequential", sync=True, versions=2)
    )
    assert summary["versions"] >= 2
    reasons = [e["reason"] for e in summary["events"] if e["kind"] == "rejected" and e["node"] == 1]
    assert reasons and all("would decompress to 67108864 bytes" in r for r in reasons)


@pytest.mark.parametrize(
    "claim,reason",
    [
        ({"upload_samples": 10**9}, "1000000000 samples claimed; a round yields at most 64"),
        # the clip measures an upload by its steps: more of them than its samples allow is a boast too
        ({"upload_samples": 8, "upload_steps": 3}, "3 steps claimed on 8 samples"),
    ],
)
def test_a_node_claiming_more_samples_or_steps_than_a_round_yields_is_rejected(tmp_path, claim, reason):
    """The sample count weights the mean: unbounded, one node claiming 10**9 owned it."""

    def script(node, msg, reply):
        if reply.has_error() or node != 1 or not report_of(reply)["upload_key"]:
            return reply
        return with_report(msg, reply, **claim)

    summary = run_coordinator(
        FakeGrid(3, client_app, script), config(tmp_path, mode="block-sequential", sync=True, versions=2)
    )
    rejected = [e for e in summary["events"] if e["kind"] == "rejected" and e["node"] == 1]
    assert rejected and all(e["cause"] == "samples" for e in rejected)
    assert reason in rejected[0]["reason"]
    assert summary["versions"] >= 2 and summary["counts"]["accepted"] >= 2


def rescaled_upload(grid, node: int, msg, reply, factor: float):
    """Node `node`'s reply with its upload replaced by a valid patch of its delta times `factor`."""
    from fedrl.patch import apply_patch, encode_patch
    from fedrl.store_client import BlockingStoreClient

    instr, report = msg.content["instruction"], report_of(reply)
    held = grid.held(node)
    names = [n for n in held if f".layers.{report['upload_block']}." in n]
    base = {n: held[n] for n in names}
    store = BlockingStoreClient(instr["store_url"], instr["principal"], instr["token"])
    try:
        honest = apply_patch(base, store.get(report["upload_key"]))
        scaled = {n: b.float() + factor * (honest[n].float() - b.float()) for n, b in base.items()}
        scaled = {n: t.to(base[n].dtype) for n, t in scaled.items()}  # in the dtype it holds
        key = store.put(
            encode_patch(base, scaled, report["upload_base_version"], report["upload_base_version"])
        )
    finally:
        store.close()
    return with_report(msg, reply, upload_key=key)


def test_an_update_far_beyond_its_peers_norms_is_refused_not_clipped_in(tmp_path):
    """Node 1 hands in its honest update x100 as a valid patch from version 1 on (in version 0
    there are no peers' norms to compare with): with a norm 100x its peers' it is refused (cause
    `norm`) and goes on its record; the honest nodes carry the run."""
    grid = None

    def script(node, msg, reply):
        if reply.has_error() or node != 1 or not report_of(reply)["upload_key"]:
            return reply
        if msg.content["instruction"]["version"] == 0:
            return reply
        return rescaled_upload(grid, node, msg, reply, 100.0)

    grid = FakeGrid(4, client_app, script)
    cfg = config(tmp_path, mode="block-sequential", sync=True, versions=4, reputation=True)
    summary = run_coordinator(grid, cfg)
    judged = [e for e in summary["events"] if e["kind"] in ("accepted", "rejected")]
    rejected = [e for e in judged if e["kind"] == "rejected"]
    assert len(rejected) >= 2 and all(e["node"] == 1 and e["cause"] == "norm" for e in rejected), judged
    assert "the median" in rejected[0]["reason"] and "refused beyond 10x" in rejected[0]["reason"]
    # x100 of an honest update that is itself near zero (every sample rewarded alike) is no
    # outlier; any other x100 must be refused, and most are
    accepted = [e for e in judged if e["kind"] == "accepted"]
    for e in accepted:
        if e["node"] == 1 and e["version"] >= 1:
            peers = [p["norm"] for p in accepted if p["version"] == e["version"] and p["node"] != 1]
            assert e["norm"] <= 10 * statistics.median(peers), (e, peers)
    assert summary["versions"] >= 4
    ids = {e["node"]: str(e["client"]) for e in summary["events"] if e["kind"] == "joined"}
    honest = min(summary["reputation"][ids[n]] for n in (2, 3, 4))
    assert summary["reputation"][ids[1]] < honest  # refusals count against it


def test_norms_that_grow_for_everyone_are_followed_not_refused(tmp_path):
    """Every node's update grows 1.5x per version (as top-k uploads with error feedback grow
    while their residuals fill up): the clip's median follows the accepted norms, so no honest
    update is refused. A history of clipped norms stayed near its first median and refused
    the updates once they passed 10x it (22 refusals here). The recent norms (64) hold this
    whole run, so their median lags the newest by about half of it: at 1.6x a version the
    largest update came to 9.5x the median, and a suite run under load saw 10.3x, a refusal;
    at 1.5x it is 5.6x."""
    grid = None

    def script(node, msg, reply):
        if reply.has_error() or not report_of(reply)["upload_key"]:
            return reply
        return rescaled_upload(grid, node, msg, reply, 1.5 ** msg.content["instruction"]["version"])

    grid = FakeGrid(4, client_app, script)
    summary = run_coordinator(grid, config(tmp_path, mode="block-sequential", sync=True, versions=8))
    rejected = [e["reason"] for e in summary["events"] if e["kind"] == "rejected"]
    assert not rejected, rejected
    norms = {}
    for e in summary["events"]:
        if e["kind"] == "accepted":
            norms.setdefault(e["version"], []).append(e["norm"])
    assert summary["versions"] == 8 and statistics.median(norms[7]) > 10 * statistics.median(norms[0])


def test_a_run_resumed_into_a_quiet_spell_is_not_stalled_by_it(tmp_path):
    """The run's peak typical step is in its checkpoint: resumed where the recent norms had gone
    nearly silent (a collapsed policy's), updates of the run's usual size are measured against
    half that peak, not refused as 1,000x the quiet median. A checkpoint without the peak (made
    before it was kept) has its quiet window dropped: the run starts both again, as a new run
    does. Kept as it was, that window refused every update of the usual size (a CI run under load
    saw 200 refusals in a row)."""
    cfg = config(tmp_path, mode="block-sequential", sync=True, versions=5, refuse_multiple=10.0)
    first = run_coordinator(FakeGrid(4, client_app), cfg)
    assert first["counts"]["rejected"] == 0
    norms = [e["norm"] for e in first["events"] if e["kind"] == "accepted"]
    manifest = max((tmp_path / "run" / "checkpoints").glob("ckpt-*.json"))
    record = json.loads(manifest.read_text())
    peak = record["meta"]["step_peak"]
    assert 0 < peak <= max(norms), (peak, norms)
    record["meta"]["recent_unit_norms"] = [peak / 1000] * 64  # the quiet spell
    for kept in (True, False):
        if not kept:
            del record["meta"]["step_peak"]
        manifest.write_text(json.dumps(record))
        resumed = run_coordinator(FakeGrid(4, client_app), cfg.replace(versions=6, stall_replies=8))
        assert resumed["versions"] == 6, (kept, resumed["stop_reason"], resumed["counts"])
        refused = [e for e in resumed["events"] if e["kind"] == "rejected" and e["cause"] == "norm"]
        assert not refused, (kept, refused)
        resumed_ckpt = json.loads((tmp_path / "run" / "checkpoints" / "ckpt-00000006.json").read_text())
        window = resumed_ckpt["meta"]["recent_unit_norms"]
        assert (peak / 1000 in window) == kept, (kept, window)  # the quiet norms kept beside their peak only
        for old in (tmp_path / "run" / "checkpoints").glob("ckpt-00000006.*"):
            old.unlink()  # the next try resumes from v5 again
        (tmp_path / "run" / "summary.json").unlink()


def reversing_node(cfg, attacker: int, client_app):
    """A FakeGrid whose node `attacker` hands in, at its honest update's size, a step straight
    down the probe's reference direction (what an attacker trained to raise the error sends):
    inside every norm bound, so only the direction check can tell."""
    from fedrl.lora import build_adapter_model
    from fedrl.patch import apply_patch, encode_patch
    from fedrl.store_client import BlockingStoreClient
    from fedrl.strategies.direction import DirectionCheck
    from fedrl.tasks import get_task

    adapter = build_adapter_model(cfg.model, cfg.lora_rank, cfg.lora_alpha, cfg.num_blocks)
    check = DirectionCheck(adapter, get_task(cfg.task, **json.loads(cfg.task_params)), 16, cfg.seed)
    grid = None

    def script(node, msg, reply):
        if reply.has_error() or node != attacker or not report_of(reply)["upload_key"]:
            return reply
        instr, report = msg.content["instruction"], report_of(reply)
        wire = grid.held(attacker)  # uploads are patches against these values, in their dtype
        held = {n: t.float() for n, t in wire.items()}
        names = adapter.part.names(report["upload_block"])
        store = BlockingStoreClient(instr["store_url"], instr["principal"], instr["token"])
        try:
            honest = apply_patch({n: wire[n] for n in names}, store.get(report["upload_key"]))
            size = sum(float((honest[n].float() - held[n]).square().sum()) for n in names) ** 0.5
            ref = check.reference(report["upload_base_version"], held, names)
            scale = size / sum(float(ref[n].square().sum()) for n in names) ** 0.5
            down = {n: (held[n] - scale * ref[n]).to(wire[n].dtype) for n in names}
            v = report["upload_base_version"]
            key = store.put(encode_patch({n: wire[n] for n in names}, down, v, v))
        finally:
            store.close()
        return with_report(msg, reply, upload_key=key)

    grid = FakeGrid(cfg.min_nodes, client_app, script)
    return grid  # the script reads what its node holds from it


def rests_doubling(rests: list[dict], cap: int = 32) -> list[int]:
    """The rests' rounds, checked to double after each refusal in a row up to the cap, or to
    start again at 1 after an accepted update (one of zeros, when the honest update it reverses
    moved nothing, is accepted)."""
    rounds = [e["rounds"] for e in rests]
    assert rounds and rounds[0] == 1 and all(b in (1, min(2 * a, cap)) for a, b in zip(rounds, rounds[1:]))
    return rounds


def test_a_client_whose_updates_point_away_from_the_answers_is_refused(tmp_path):
    """Node 1 reverses its updates along the probe's reference direction. Once the check has
    enough cosines to measure their spread, each of node 1's updates is refused (cause
    `direction`) and its record is in the checkpoint. After each refusal it sits out 1, 2,
    4, ... rounds, so it is asked fewer rounds than the honest nodes."""
    # 12 versions: a rest lasts the refused round's wall seconds, so on a loaded machine the node can
    # miss rounds beyond its rest (with 6, 3 runs in 8 beside busy loops saw one refusal only; with
    # 8, one suite run of stop 92 saw its first refusal at its 4th update and no round after it)
    cfg = config(tmp_path, mode="block-sequential", sync=True, versions=12, direction_probe=16)
    grid = reversing_node(cfg, 1, client_app)
    summary = run_coordinator(grid, cfg)
    mine = [e for e in summary["events"] if e["kind"] in ("accepted", "rejected") and e["node"] == 1]
    # straight down the reference (a round whose honest update was empty hands in nothing: 0)
    assert sum(e["cosine"] < -0.9 for e in mine) >= len(mine) - 1, mine
    refused = [e for e in mine if e["kind"] == "rejected"]
    assert len(refused) >= 2 and all(e["cause"] == "direction" for e in refused), mine
    # until then its updates were merged at weight max(cos - bar, 0): nothing; others' at their
    # cosine above the bar (0, or twice the recent cosines' median where that is below 0)
    assert all(e["weight"] == 0 for e in mine if e["kind"] == "accepted" and e["cosine"] < 0), mine
    others = [e for e in summary["events"] if e["kind"] == "accepted" and e["node"] != 1]
    assert others and all(e["bar"] <= 0 for e in others), others
    assert all(e["weight"] == pytest.approx(max(e["cosine"] - e["bar"], 0), abs=1e-3) for e in others), others
    assert mine[-1]["kind"] == "rejected" and "away from the task's answers" in mine[-1]["reason"]
    assert summary["versions"] >= 12
    rests = [e for e in summary["events"] if e["kind"] == "resting"]
    assert [e["node"] for e in rests] == [1] * len(refused), rests
    assert max(rests_doubling(rests)) >= 2
    # each rest is told to the node, with its length: its owner would otherwise see no work, and no why
    told = [instr["rest_s"] for node, instr in grid.sent if instr["action"] == "rest"]
    assert told == pytest.approx([e["rest_s"] for e in rests], abs=1e-3) and all(told), told
    asked = {node: summary["clients"][str(node)]["messages"] for node in (1, 2, 3)}
    assert asked[1] < asked[2] == asked[3], asked  # sync rounds: the honest nodes are asked every one
    from fedrl.strategies.checkpoint import load_checkpoints

    _, _, meta = next(iter(load_checkpoints(tmp_path / "run" / "checkpoints")))
    client = next(e["client"] for e in summary["events"] if e["kind"] == "joined" and e["node"] == 1)
    # an empty update (cosine 0) is measured against nothing, so it is not on the record
    assert meta["direction"]["records"][str(client)][0] == sum(e["cosine"] != 0 for e in mine)
    # the ledger says the same of each node: node 1's refusals by cause, the samples of what was
    # merged at a weight above 0 (the rest added nothing), and how many were merged at weight 0
    ledger = summary["ledger"]
    assert ledger["1"]["refused"] == {"direction": len(refused)} and ledger["1"]["client"] == client
    for node in (1, 2, 3):
        merged = [e for e in summary["events"] if e["kind"] == "accepted" and e["node"] == node]
        row = ledger[str(node)]
        assert row["accepted"] == len(merged) and row["weightless"] == sum(e["weight"] == 0 for e in merged)
        assert row["samples"] == sum(e["samples"] for e in merged if e["weight"] > 0)
        assert ledger[str(node)]["replies"] == asked[node]  # every round answered with a report
    assert ledger["2"]["samples"] > 0 and not ledger["2"]["refused"]
    assert ledger["1"]["weightless"] > 0, ledger["1"]  # its accepted steps down weighed nothing


def test_a_refused_client_is_asked_nothing_until_its_rest_is_over_on_a_virtual_clock(tmp_path):
    """On the simulation's virtual clock, where times are exact: each rest lasts its rounds times
    the refused round's length, and the node's next round starts no sooner than the rest's end.
    The honest nodes take the run to its versions meanwhile."""
    from fedrl.sim.apps import client_app as simulated_client_app
    from fedrl.sim.simulated_server import SimConfig, run_simulated

    cfg = config(tmp_path, mode="block-sequential", sync=True, versions=10, direction_probe=16)
    sim = SimConfig(clock="virtual", step_s=1.0, profiles=json.dumps([{"name": "steady", "speed": 1.0}] * 3))
    summary = run_simulated(reversing_node(cfg, 1, simulated_client_app), cfg, sim)
    assert summary["versions"] >= 10
    events = summary["events"]
    rests = [e for e in events if e["kind"] == "resting"]
    assert {e["node"] for e in rests} == {1}, rests
    assert max(rests_doubling(rests)) >= 4
    checked = 0
    for rest in rests:
        replies = [e for e in events if e["kind"] == "reply" and e["node"] == 1 and e["t"] > rest["t"]]
        refused_round = next(
            e for e in reversed(events) if e["kind"] == "reply" and e["node"] == 1 and e["t"] <= rest["t"]
        )
        assert rest["rest_s"] == pytest.approx(rest["rounds"] * refused_round["duration_s"], rel=1e-3)
        if replies:  # sent when its rest was over
            assert replies[0]["t"] - replies[0]["duration_s"] >= rest["t"] + rest["rest_s"] - 1e-3, rest
            checked += 1
    assert checked >= 1


def test_the_direction_check_is_off_with_a_note_for_a_task_without_text_answers(tmp_path):
    """It is on by default; the digits bandit's targets are actions, not answers a reference
    direction could be made of, so a run on it goes on without the check and says why."""
    from fedrl.strategies.coordinator import Coordinator

    with Coordinator(
        FakeGrid(3, client_app), config(tmp_path, task="digits", task_params="{}")
    ) as coordinator:
        assert coordinator.direction is None and "needs text prompts" in coordinator.direction_off
    with Coordinator(FakeGrid(3, client_app), config(tmp_path / "b")) as coordinator:
        assert coordinator.direction is not None and coordinator.direction.weighting == "cosine"


def test_a_direction_check_that_fails_for_another_reason_stops_the_start(tmp_path, monkeypatch):
    """Only a task without text answers turns the check off: any other error in building it
    (here a stand-in for a bad value that bypassed RunConfig) fails the start, rather than
    running unguarded under a wrong reason."""
    import fedrl.strategies.coordinator as coordinator_module

    def broken(*args):
        raise ValueError("false_refusal must be a chance")

    monkeypatch.setattr(coordinator_module, "DirectionCheck", broken)
    with pytest.raises(ValueError, match="false_refusal must be a chance"):
        coordinator_module.Coordinator(FakeGrid(3, client_app), config(tmp_path))


def test_a_resumed_run_keeps_the_held_out_evals_made_after_its_last_checkpoint(tmp_path):
    """Found by `bench chaos` (kill loop): the eval of a version ran after that version's
    checkpoint, so a coordinator killed before the next version lost it from its history."""
    first = run_coordinator(FakeGrid(3, client_app), small_config(tmp_path, versions=3, eval_every=1))
    evaluated = {e["version"]: e["error"] for e in first["evals"]}
    # each version once: the final version's eval is its final eval, not made again
    assert [e["version"] for e in first["evals"]] == list(range(first["versions"] + 1))
    more = small_config(tmp_path, versions=first["versions"] + 1, eval_every=1)
    second = run_coordinator(FakeGrid(3, client_app), more)
    kept = {e["version"]: e["error"] for e in second["evals"]}
    assert {v: kept.get(v) for v in evaluated} == evaluated and first["versions"] + 1 in kept


def test_the_best_adapter_names_only_a_version_whose_checkpoint_is_on_disk(tmp_path, monkeypatch):
    """A checkpoint is written in the background while the version is evaluated; had adapter-best
    been written first and the coordinator been killed in between, the resumed run would make
    that version again while adapter-best held the weights of its lost first making."""
    from fedrl.strategies.best_adapter import BestAdapter
    from fedrl.strategies.checkpoint import Checkpointer

    write, offer, on_disk = Checkpointer.write, BestAdapter.offer, {}

    def slow_write(self, version, tensors, meta):
        time.sleep(0.3)  # a large state, or a slow disk
        return write(self, version, tensors, meta)

    def offer_seen(self, error, version, save, record):
        on_disk[version] = {
            json.loads(p.read_text())["version"] for p in tmp_path.glob("run/checkpoints/*.json")
        }
        return offer(self, error, version, save, record)

    monkeypatch.setattr(Checkpointer, "write", slow_write)
    monkeypatch.setattr(BestAdapter, "offer", offer_seen)
    summary = run_coordinator(FakeGrid(3, client_app), small_config(tmp_path, versions=3, eval_every=1))
    assert sorted(on_disk) == list(range(summary["versions"] + 1))
    assert all(v in seen for v, seen in on_disk.items() if v), on_disk  # v0 is never checkpointed


def test_a_resumed_run_goes_on_with_each_nodes_round_numbers(tmp_path):
    """Found by `bench chaos` (kill loop): round numbers, which seed a client's sampling, started
    again at 1 after a restart, so every life of a killed run replayed the same prompts."""
    first_grid, second_grid = FakeGrid(3, client_app), FakeGrid(3, client_app)
    first = run_coordinator(first_grid, small_config(tmp_path, versions=2))
    run_coordinator(second_grid, small_config(tmp_path, versions=first["versions"] + 2))
    for node in (1, 2, 3):
        before = [i["round"] for n, i in first_grid.sent if n == node]
        after = [i["round"] for n, i in second_grid.sent if n == node]
        assert after and min(after) > max(before), (node, before, after)


def test_top_k_uploads_are_sparse_patches_and_the_rest_stays_with_the_client(tmp_path):
    """upload_density 0.05: each upload changes at most 5% of its block's entries (the patch
    the coordinator applies says exactly that), in the wire dtype the client holds the global
    values in, and the unsent rest (rounding included) is the client's residual."""
    dense = run_coordinator(FakeGrid(3, client_app), config(tmp_path / "dense"))
    grid = FakeGrid(3, client_app)
    sparse = run_coordinator(grid, config(tmp_path / "sparse", upload_density=0.05))
    assert sparse["versions"] >= 3 and sparse["counts"]["rejected"] == 0
    up = lambda s: s["bytes_up"] / s["counts"]["accepted"]  # noqa: E731
    assert up(sparse) < up(dense) / 4, (up(sparse), up(dense))
    states = [ctx.state for ctx in grid.contexts.values() if "residual" in ctx.state.array_records]
    assert states, "no client kept a residual"
    residual = states[0].array_records["residual"].to_torch_state_dict()
    assert any(float(t.abs().max()) > 0 for t in residual.values())
    # bfloat16 values are a few ulps from the base's; float32 ones differ in every bit
    wide_cfg = config(tmp_path / "fp32", upload_density=0.05, wire_dtype="float32")
    wide = run_coordinator(FakeGrid(3, client_app), wide_cfg)
    assert wide["counts"]["rejected"] == 0
    assert up(sparse) < 0.7 * up(wide), (up(sparse), up(wide))


def test_kept_optimizer_state_goes_on_across_a_nodes_rounds(tmp_path):
    """keep_optimizer_state: each node's Adam state per tensor lives on in its Flower state, so
    a tensor's step count goes on over the node's rounds on its block."""
    grid = FakeGrid(3, client_app)
    summary = run_coordinator(grid, config(tmp_path, keep_optimizer_state=True, versions=4))
    assert summary["counts"]["rejected"] == 0 and summary["counts"]["errors"] == 0
    for node, ctx in grid.contexts.items():
        moments = ctx.state.array_records["moments"].to_torch_state_dict()
        per_layer = {}  # a layer's tensors belong to one block and step together
        for key, value in moments.items():
            if key.endswith(":step"):
                per_layer.setdefault(key.split(".layers.")[1].split(".")[0], set()).add(int(value))
        steps = [e["steps"] for e in summary["events"] if e["kind"] == "reply" and e["node"] == node]
        assert all(len(s) == 1 for s in per_layer.values()), per_layer
        most = max(max(s) for s in per_layer.values())
        assert max(steps) < most <= sum(steps), (per_layer, steps)


def test_top_k_uploads_are_measured_by_the_steps_of_their_clients_latest_rounds_on_the_block(tmp_path):
    """With error feedback an upload carries what the client's latest rounds on its block left
    in the residual: the clip measures it by the steps of the last `feedback_window` uploads of
    that client and block (2 at 15%), which are checkpointed, and a resumed run goes on from
    them (from an older checkpoint's running total too); dense uploads keep their own round's."""
    from fedrl.strategies.aggregation import feedback_window

    def steps_by_upload(summary):
        clients = {e["node"]: e["client"] for e in summary["events"] if e["kind"] == "joined"}
        seen = {}
        for e in summary["events"]:
            if e["kind"] == "accepted":
                seen.setdefault((clients[e["node"]], e["block"]), []).append(e["steps"])
        return seen

    def rounds_of(steps, before=0):  # each upload's own round: what it adds to the one before
        rounds = [steps[0] - before]
        for s in steps[1:]:
            rounds.append(s - rounds[-1])
        return rounds

    assert feedback_window(0.15) == 2
    cfg = config(tmp_path, versions=6, upload_density=0.15)
    first = steps_by_upload(run_coordinator(FakeGrid(3, client_app), cfg))
    assert any(len(s) >= 3 for s in first.values()), first
    assert all(1 <= r <= 4 for s in first.values() for r in rounds_of(s)), first
    manifest = max((tmp_path / "run" / "checkpoints").glob("ckpt-*.json"))
    record = json.loads(manifest.read_text())
    windows = {(c, b): n for c, b, n in record["meta"]["feedback_steps"]}
    assert windows and all(len(n) <= 2 and sum(n) in first[k] for k, n in windows.items()), (windows, first)
    # an older checkpoint kept one running total per client and block: resumed as one round's
    record["meta"]["feedback_steps"] = [[c, b, 100] for c, b in windows]
    manifest.write_text(json.dumps(record))
    second = steps_by_upload(run_coordinator(FakeGrid(3, client_app), cfg.replace(versions=9)))
    resumed = [s for k, s in second.items() if k in windows]
    assert resumed and all(1 <= r <= 4 for s in resumed for r in rounds_of(s, before=100)), second
    assert any(len(s) >= 2 and s[1] <= 8 for s in resumed), second  # the total left the window
    dense = steps_by_upload(run_coordinator(FakeGrid(3, client_app), config(tmp_path / "dense", versions=6)))
    assert all(1 <= n <= 4 for steps in dense.values() for n in steps), dense


def test_an_update_made_on_an_old_state_and_labelled_with_the_current_base_is_refused(tmp_path):
    """A liar about its base (node 1 uploads its block as it was at v0, labelled with the base it
    was sent): measured against that base it would roll the block back, so it is refused."""
    from fedrl.patch import encode_patch
    from fedrl.store_client import BlockingStoreClient

    grid, first_held = None, {}

    def script(node, msg, reply):
        if reply.has_error() or node != 1 or not report_of(reply)["upload_key"]:
            return reply
        instr, report = msg.content["instruction"], report_of(reply)
        held = grid.held(1)
        first_held.setdefault("v0", {k: v.clone() for k, v in held.items()})
        if instr["version"] < 3:
            return reply
        names = [n for n in held if f".layers.{report['upload_block']}." in n]
        store = BlockingStoreClient(instr["store_url"], instr["principal"], instr["token"])
        key = store.put(
            encode_patch(
                {n: held[n] for n in names},
                {n: first_held["v0"][n] for n in names},
                report["upload_base_version"],
                report["upload_base_version"],
            )
        )
        store.close()
        return with_report(msg, reply, upload_key=key)

    grid = FakeGrid(3, client_app, script)
    summary = run_coordinator(grid, config(tmp_path, mode="block-sequential", sync=True, versions=6))
    rejected = [e for e in summary["events"] if e["kind"] == "rejected"]
    assert rejected and all(e["node"] == 1 and e["cause"] == "rollback" for e in rejected), rejected
    assert "nearer version 0 than the base version" in rejected[0]["reason"]
    assert summary["versions"] >= 6


def test_a_node_that_fell_behind_skips_the_chain(tmp_path, monkeypatch):
    """A node away for several versions comes back holding v0: the catalog has patches straight
    from each retained version to the latest, so it does not walk the chain version by version
    (there is no anchor but v0, so without skips it would download one patch per version)."""
    grid = None

    def script(node, msg, reply):
        version = msg.content["instruction"]["version"]
        if node == 3 and version == 0:
            grid.leave(3)  # away after its first round, holding v0
        elif node != 3 and version >= 3:
            grid.join(3)
        return reply

    from fedrl.strategies.coordinator import Coordinator

    monkeypatch.setattr(Coordinator, "refresh_every_s", 0.0)  # sees the return at once
    grid = FakeGrid(3, client_app, script)
    cfg = config(tmp_path, mode="parablock", sync=False, versions=6, buffer_size=1, anchor_every=100)
    summary = run_coordinator(grid, cfg)
    back = [
        e
        for e in summary["events"]
        if e["kind"] == "reply" and e["node"] == 3 and e["sync_patches"] and e["synced_version"] >= 3
    ]
    assert back, "node 3 never came back"
    assert back[0]["sync_patches"] < back[0]["synced_version"], back[0]  # fewer than the chain's links
    assert 0 < back[0]["bytes_down"] < back[0]["full_sync_bytes"], back[0]  # its cache saved the anchor


def test_bfloat16_on_the_wire_narrows_downloads_and_clients_hold_the_exact_cast(tmp_path):
    """wire_dtype bfloat16: versions travel as bf16 casts of the coordinator's float32 state
    (patches between casts are small), uploads as bf16 patches against them, clients hold those
    casts bit for bit, and the coordinator merges, checkpoints and exports in float32."""
    from fedrl.patch import state_hash
    from fedrl.strategies.checkpoint import load_checkpoints

    wide = run_coordinator(FakeGrid(3, client_app), config(tmp_path / "fp32", wire_dtype="float32"))
    grid = FakeGrid(3, client_app)
    narrow = run_coordinator(grid, config(tmp_path / "bf16", wire_dtype="bfloat16"))
    assert narrow["versions"] >= 3 and narrow["counts"]["rejected"] == 0
    down = lambda s: s["bytes_down"] / s["rounds"]  # noqa: E731
    assert down(narrow) < 0.6 * down(wide), (down(narrow), down(wide))
    up = lambda s: s["bytes_up"] / s["counts"]["accepted"]  # noqa: E731
    assert up(narrow) < 0.7 * up(wide), (up(narrow), up(wide))
    masters = {v: t for v, t, _ in load_checkpoints(tmp_path / "bf16" / "run" / "checkpoints")}
    assert all(t.dtype == torch.float32 for state in masters.values() for t in state.values())
    compared = 0
    for ctx in grid.contexts.values():
        held = load_state(ctx.state)  # as the node's next message finds it in Flower's context
        if held.held_version in masters:
            cast = {n: t.to(torch.bfloat16) for n, t in masters[held.held_version].items()}
            assert state_hash(held.held) == state_hash(cast), f"a client's v{held.held_version} differs"
            compared += 1
    assert compared, "no client held a checkpointed version"


def test_a_wire_dtype_that_is_not_a_float_is_refused(tmp_path):
    with pytest.raises(ValueError, match="wire_dtype must be one of"):
        config(tmp_path, wire_dtype="int8")


def test_nodes_build_v0_themselves_and_a_node_whose_build_differs_downloads_it(tmp_path):
    """Every node builds the seeded adapter; cast to the wire dtype it is v0, and the instruction
    says v0's hash, so a node's first sync downloads no patch. A node told another hash (its
    build differs) holds nothing and takes the anchor, as before; the run is the same."""

    class Grid(FakeGrid):
        def reply_to(self, node, msg):
            # as if node 2's seeded build came out different (the settings it keeps say so)
            if node == 2 and "settings" in msg.content.config_records:
                msg.content["settings"]["origin_hash"] = "0" * 64
            return super().reply_to(node, msg)

    grid = Grid(3, client_app)
    summary = run_coordinator(grid, config(tmp_path, mode="parablock", sync=False, wire_dtype="bfloat16"))
    assert summary["versions"] >= 3 and summary["counts"]["rejected"] == 0
    first = {}
    for e in summary["events"]:
        if e["kind"] == "reply":
            first.setdefault(e["node"], e)
    assert all(e["synced_version"] == 0 for e in first.values()), first
    for e in (first[1], first[3]):
        assert e["sync_patches"] == 0 and e["bytes_down"] < 0.05 * e["full_sync_bytes"], e  # the catalog only
    e = first[2]
    assert e["sync_patches"] == 1 and e["bytes_down"] >= e["full_sync_bytes"] > 0, e


def test_flower_messages_are_counted_and_settings_travel_once_per_node(tmp_path):
    from fedrl.strategies.coordinator import wire_bytes

    class MeasuringGrid(FakeGrid):
        down = up = 0
        carried: list[int] = []  # the nodes of the messages that carried the settings

        def reply_to(self, node, msg):
            size = wire_bytes(msg)  # as it came, before the fake grid shows scripts the whole instruction
            if "settings" in msg.content.config_records:
                self.carried.append(node)
            self.down += size
            return super().reply_to(node, msg)

        def pull_messages(self, ids):  # the answers to notices (the run's end) are never pulled
            replies = super().pull_messages(ids)
            self.up += sum(map(wire_bytes, replies))
            return replies

    grid = MeasuringGrid(3, client_app)
    summary = run_coordinator(grid, config(tmp_path))
    assert (summary["control_bytes_down"], summary["control_bytes_up"]) == (grid.down, grid.up)
    assert sorted(grid.carried) == sorted({node for node, _ in grid.sent}) and summary["rounds"] > 3 * 3
    assert summary["counts"]["errors"] == 0
    # an instruction without its settings is a head of round fields: a tenth of a whole one
    assert summary["control_bytes_down"] / summary["rounds"] < 400


def test_a_node_that_lost_its_settings_says_so_and_is_sent_them_again(tmp_path):
    from fedrl.protocol import SETTINGS_UNKNOWN

    class ForgetfulGrid(FakeGrid):
        forgot = False

        def reply_to(self, node, msg):
            if node == 1 and not self.forgot and len([n for n, _ in self.sent if n == 1]) == 2:
                del self.contexts[1].state["settings"]  # as a restarted ClientApp would have lost it
                self.forgot = True
            return super().reply_to(node, msg)

    grid = ForgetfulGrid(3, client_app)
    summary = run_coordinator(grid, config(tmp_path, versions=4))
    errors = [e for e in summary["events"] if e["kind"] == "error"]
    assert grid.forgot and len(errors) == 1 and errors[0]["reason"].startswith(SETTINGS_UNKNOWN), errors
    assert errors[0]["node"] == 1 and summary["versions"] >= 4
    replies = [e for e in summary["events"] if e["kind"] == "reply" and e["node"] == 1]
    assert [e for e in replies if e["t"] >= errors[0]["t"]], "node 1 works again, sent the settings"
    assert summary["counts"]["rejected"] == 0


def test_a_node_restarted_between_two_messages_is_sent_the_settings_after_its_lost_message(tmp_path):
    """Restarted within its heartbeat patience, a node never leaves the Grid's list: what shows is
    its lost message (an error). Its next message carries the settings; none is refused for them."""
    from flwr.common.constant import ErrorCode

    from fedrl.protocol import SETTINGS_UNKNOWN

    class RestartingGrid(FakeGrid):
        restarted = False

        def reply_to(self, node, msg):
            if node == 1 and not self.restarted and len([n for n, _ in self.sent if n == 1]) == 2:
                self.restarted = True
                self.join(1, restarted=True)  # the new ClientApp holds nothing
                return Message(Error(code=ErrorCode.MESSAGE_UNAVAILABLE, reason="message lost"), reply_to=msg)
            return super().reply_to(node, msg)

    grid = RestartingGrid(3, client_app)
    summary = run_coordinator(grid, config(tmp_path, versions=4))
    errors = [e["reason"] for e in summary["events"] if e["kind"] == "error"]
    assert grid.restarted and errors == ["message lost"], errors
    replies = [e for e in summary["events"] if e["kind"] == "reply" and e["node"] == 1]
    assert len(replies) >= 2 and summary["versions"] >= 4 and not any(SETTINGS_UNKNOWN in r for r in errors)


def test_a_node_of_another_fedrl_version_is_named_rested_and_taken_back_once_upgraded(tmp_path, monkeypatch):
    """A node whose fedrl speaks another protocol cannot read an instruction: its ClientApp refuses
    it by name. The coordinator says so (cause "version"), asks that node nothing more until a rest
    on the run's clock has passed rather than every round, and takes it back once it answers
    (its owner upgraded it); the other nodes' work takes the run to its versions."""
    import fedrl.strategies.coordinator as coordinator_module
    from fedrl.protocol import MESSAGE_TYPE, InstructionHead
    from fedrl.schema import PROTOCOL

    rest_s = 1.0  # short beside the run (about 10 s alone): on a loaded machine node 3 may first be
    # asked late, and a run that ends within its rest never asks again (3 s failed so once)
    monkeypatch.setattr(coordinator_module, "OTHER_VERSION_REST_S", rest_s)
    asked = []  # when node 3's ClientApp got each message (never before it was sent)

    def script(node, msg, reply):
        if node != 3:
            return reply
        asked.append(time.monotonic())  # the run's clock here is the wall's
        if len(asked) > 1:  # its owner upgraded it after its first refusal
            return reply
        head = InstructionHead.pack({k: msg.content["instruction"][k] for k in InstructionHead.model_fields})
        head = at_protocol(head, PROTOCOL + 1)  # as a newer coordinator would send it
        newer = Message(
            RecordDict({"instruction": ConfigRecord(head)}), dst_node_id=node, message_type=MESSAGE_TYPE
        )
        refusal = client_app(newer, grid.contexts[node])  # the node's real ClientApp reads it
        return Message(refusal.error, reply_to=msg)

    grid = FakeGrid(3, client_app, script)
    summary = run_coordinator(grid, config(tmp_path, versions=5))
    assert summary["versions"] >= 5 and summary["counts"]["rejected"] == 0
    refused = [e for e in summary["events"] if e.get("cause") == "version"]
    assert [e["node"] for e in refused] == [3]
    assert (
        f"the peer speaks fedrl protocol {PROTOCOL + 1}, this fedrl protocol {PROTOCOL}"
        in refused[0]["reason"]
    )
    assert refused[0]["asked_again_in_s"] == rest_s
    assert len(asked) >= 2 and asked[1] - asked[0] >= rest_s  # not asked again before its rest
    assert summary["clients"]["3"]["messages"] >= 1  # then its replies counted
    accepted = [e for e in summary["events"] if e["kind"] == "accepted" and e.get("node") == 3]
    assert accepted and accepted[0]["t"] >= refused[0]["t"] + rest_s
