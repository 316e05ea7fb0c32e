"""Keys that survive restarts, clients that pin them, and what is refused: a coordinator with
another key, a patch signed by another key, a bad node config, a bad pins file."""

import json

import pytest
import torch
from fake_grid import FakeGrid, instruction_record, small_config

from fedrl.clients.block_worker import ClientState, handle
from fedrl.clients.client_app import app as client_app
from fedrl.clients.model_cache import ModelCache
from fedrl.clients.node import KeyChanged, NodeSettings, check_pin, load_pins, save_pins
from fedrl.credentials import ADMIN, load_or_create_secret, node_principal, read_secret, token_for
from fedrl.lora import build_adapter_model
from fedrl.patch import encode_patch
from fedrl.patch_chain import SyncFailed
from fedrl.patch_store import PatchStoreServer, StoreState
from fedrl.protocol import TrainInstruction
from fedrl.signing import generate_signing_key, load_or_create_signing_key, public_key_pem
from fedrl.store_client import BlockingStoreClient, put_signed_patches
from fedrl.strategies.coordinator import Coordinator, run_coordinator


@pytest.fixture(autouse=True)
def task_identity():
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0


def pem(key) -> str:
    return public_key_pem(key).decode()


def test_keys_and_secrets_are_made_once_and_read_back(tmp_path):
    key = load_or_create_signing_key(tmp_path / "k" / "coordinator.key")
    assert pem(load_or_create_signing_key(tmp_path / "k" / "coordinator.key")) == pem(key)
    assert (tmp_path / "k" / "coordinator.key").stat().st_mode & 0o077 == 0  # owner only
    secret = load_or_create_secret(tmp_path / "s")
    assert load_or_create_secret(tmp_path / "s") == secret and len(secret) == 64
    (tmp_path / "short").write_text("abc")
    with pytest.raises(ValueError, match="holds 3 bytes"):
        read_secret(tmp_path / "short")
    with pytest.raises(ValueError, match="cannot read the secret file"):
        read_secret(tmp_path / "missing")
    (tmp_path / "garbage.key").write_text("not a key")
    with pytest.raises(ValueError, match="not an unencrypted PEM private key"):
        load_or_create_signing_key(tmp_path / "garbage.key")


def test_a_restarted_coordinator_keeps_its_key_and_store_secret(tmp_path):
    cfg = small_config(tmp_path)
    with Coordinator(FakeGrid(3, client_app), cfg) as first:
        key, secret = first.public_key, first.secret
    with Coordinator(FakeGrid(3, client_app), cfg) as again:
        assert again.public_key == key and again.secret == secret
    with Coordinator(FakeGrid(3, client_app), cfg.replace(state_dir=str(tmp_path / "other"))) as other:
        assert other.public_key != key


def test_pins_are_kept_on_first_sight_and_a_different_key_is_refused(tmp_path):
    a, b = pem(generate_signing_key()), pem(generate_signing_key())
    pins = check_pin({}, "https://store:1", a)
    assert check_pin(pins, "https://store:1", a) == pins
    assert set(check_pin(pins, "https://other:2", b)) == {"https://store:1", "https://other:2"}
    with pytest.raises(KeyChanged, match="pinned"):
        check_pin(pins, "https://store:1", b)
    save_pins(str(tmp_path), pins)
    assert load_pins(str(tmp_path)) == pins and load_pins("") == {}
    (tmp_path / "coordinator-keys.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a table"):
        load_pins(str(tmp_path))
    (tmp_path / "coordinator-keys.json").write_text("{broken")
    with pytest.raises(ValueError, match="cannot be read"):
        load_pins(str(tmp_path))


def test_node_settings_take_fedrl_keys_and_check_them(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    settings = NodeSettings.from_node_config({"ca-file": str(ca), "state-dir": "/s", "partition-id": 3})
    assert settings.ca_file == str(ca) and settings.state_dir == "/s"
    with pytest.raises(ValueError, match="not a readable file"):
        NodeSettings.from_node_config({"ca-file": str(tmp_path / "missing.pem")})
    with pytest.raises(ValueError, match="state_dir"):
        NodeSettings.from_node_config({"state-dir": 5})


def test_clients_refuse_a_coordinator_whose_key_changed_and_the_run_goes_on(tmp_path):
    grid = FakeGrid(3, client_app)
    for node, context in grid.contexts.items():
        context.node_config["state-dir"] = str(tmp_path / f"node-{node}")
    load_or_create_secret(tmp_path / "store.secret")
    with PatchStoreServer(StoreState(read_secret(tmp_path / "store.secret"))) as store:  # a standalone store
        standalone = dict(store_url=store.url, store_secret_file=str(tmp_path / "store.secret"))
        run_coordinator(grid, small_config(tmp_path, versions=1, **standalone))
        assert all((tmp_path / f"node-{n}" / "coordinator-keys.json").exists() for n in grid.contexts)
        for context in grid.contexts.values():  # a new run of the same nodes: only the disk remembers
            context.state.clear()

        # the same store, another coordinator key (its state dir was lost, or it is an impostor)
        impostor = small_config(
            tmp_path / "impostor",
            versions=1,
            stall_replies=3,
            state_dir=str(tmp_path / "impostor"),
            **standalone,
        )
        summary = run_coordinator(grid, impostor)
    errors = [e for e in summary["events"] if e["kind"] == "error"]
    assert summary["versions"] == 0 and summary["counts"]["accepted"] == 0
    assert len(errors) >= 3 and all("pinned" in e["reason"] for e in errors)
    assert "without an accepted update" in summary["stop_reason"]


def test_a_client_refuses_a_patch_signed_by_another_key(tmp_path):
    coordinator_key, rogue_key = generate_signing_key(), generate_signing_key()
    secret = load_or_create_secret(tmp_path / "secret")
    adapter = build_adapter_model("tiny-base", 8, 16.0, 3)
    poisoned = {k: torch.full_like(v, 9.0) for k, v in adapter.initial.items()}
    with PatchStoreServer(StoreState(secret)) as server:
        admin = BlockingStoreClient(server.url, ADMIN, token_for(secret, ADMIN))
        try:
            refs = put_signed_patches(admin, [(None, 0, encode_patch(None, poisoned, None, 0))], rogue_key)
            admin.publish({"latest": 0, "refs": refs, "public_key": pem(rogue_key)})
        finally:
            admin.close()
        instr = TrainInstruction.parse(
            instruction_record(
                store_url=server.url,
                principal=node_principal(1),
                token=token_for(secret, node_principal(1)),
                public_key=pem(
                    coordinator_key
                ),  # what the coordinator told the client over the control plane
                task_params=json.dumps({"length": 8}),
                mode="block-sequential",
            )
        )
        with pytest.raises(SyncFailed, match="does not verify"):
            handle(instr, ClientState(), ModelCache())
