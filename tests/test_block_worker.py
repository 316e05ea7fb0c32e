import pytest
import torch
from fake_grid import instruction_record

from fedrl.clients.block_worker import block_correction
from fedrl.clients.runtime import overlap_seconds
from fedrl.protocol import LearnerSettings, TrainInstruction, TrainReport
from fedrl.schema import SchemaError
from fedrl.strategies.run_config import RunConfig


def test_block_correction_rebases_own_block_and_takes_global_elsewhere():
    local = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([5.0])}
    base = {"a": torch.tensor([0.5, 1.0])}  # block a's values when compute started
    new_global = {"a": torch.tensor([10.0, 20.0]), "b": torch.tensor([7.0])}
    corrected, new_base = block_correction(local, base, new_global, ["a"])
    assert torch.equal(corrected["b"], torch.tensor([7.0]))
    assert torch.equal(corrected["a"], torch.tensor([10.5, 21.0]))  # global + local progress
    assert torch.equal(new_base["a"], new_global["a"])
    # the delta reported later is exactly the local progress
    assert torch.equal(corrected["a"] - new_base["a"], local["a"] - base["a"])


def test_overlap_seconds():
    assert overlap_seconds((0, 4), (1, 2)) == 1
    assert overlap_seconds((0, 1), (2, 3)) == 0
    assert overlap_seconds((0, 3), (2, 5)) == 1


_instruction = instruction_record


def test_instruction_round_trip_and_validation():
    instr = TrainInstruction.parse(_instruction())
    assert TrainInstruction.parse(instr.to_record()) == instr
    with pytest.raises(SchemaError, match="block: Field required"):
        TrainInstruction.parse({k: v for k, v in _instruction().items() if k != "block"})
    with pytest.raises(SchemaError, match="steps: Input should be a valid integer"):
        TrainInstruction.parse(_instruction(steps="many"))
    with pytest.raises(SchemaError, match="does not fit"):
        TrainInstruction.parse(_instruction(block=5))
    with pytest.raises(SchemaError, match="does not fit"):
        TrainInstruction.parse(_instruction(mode="fedavg-lora", block=0))
    with pytest.raises(SchemaError):
        TrainInstruction.parse(_instruction(mode="gossip"))
    with pytest.raises(SchemaError, match="JSON"):
        TrainInstruction.parse(_instruction(task_params="{not json"))
    with pytest.raises(SchemaError, match="upload_density must be in"):
        TrainInstruction.parse(_instruction(upload_density=-0.5))  # a malformed message, not a crash later
    for temperature in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(SchemaError, match="temperature must be a finite number > 0"):
            TrainInstruction.parse(_instruction(temperature=temperature))
    with pytest.raises(SchemaError, match="profile: Extra inputs are not permitted"):
        TrainInstruction.parse(_instruction(profile="{}"))  # simulated traits do not travel in the protocol


def test_a_wrong_type_anywhere_is_one_line():
    with pytest.raises(SchemaError) as err:
        TrainInstruction.parse(_instruction(steps=True, lr="fast", seed=1.5))
    message = str(err.value)
    assert "\n" not in message and "steps" in message and "lr" in message and "seed" in message


def test_report_rejects_a_bad_upload_key():
    fields = dict(
        upload_key="xyz",
        upload_block=0,
        upload_base_version=0,
        upload_samples=1,
        synced_version=0,
        reward=0.0,
        loss=0.0,
        gate_mean=0.0,
        steps=1,
        compute_s=0.0,
        comm_s=0.0,
        overlap_s=0.0,
        duration_s=0.0,
        bytes_up=0,
        bytes_down=0,
        staleness=0,
        link_bytes_per_s=0.0,
        memory_mb=100.0,
    )
    with pytest.raises(SchemaError, match="SHA-256"):
        TrainReport.parse(fields)
    with pytest.raises(SchemaError, match="duration_s must be a finite number"):
        TrainReport.parse({**fields, "upload_key": "", "duration_s": float("nan")})
    with pytest.raises(SchemaError, match="memory_mb must be a finite number"):  # measured, still checked
        TrainReport.parse({**fields, "upload_key": "", "memory_mb": -1.0})
    with pytest.raises(SchemaError, match="link_bytes_per_s: Field required"):
        TrainReport.parse({k: v for k, v in fields.items() if k != "link_bytes_per_s"})


def test_run_config_from_flower_style_keys_and_errors():
    cfg = RunConfig.from_mapping({"mode": "block-sequential", "buffer-size": 4, "sync": True})
    assert cfg.buffer_size == 4 and cfg.sync
    with pytest.raises(SchemaError, match="num_server_rounds: Extra inputs are not permitted"):
        RunConfig.from_mapping({"num-server-rounds": 3})
    with pytest.raises(SchemaError, match="versions"):
        RunConfig.from_mapping({"versions": 0})
    with pytest.raises(SchemaError, match="sync: Input should be a valid boolean"):
        RunConfig.from_mapping({"sync": "yes"})
    for bad in (
        {"upload-density": 0.0},
        {"upload-density": 1.5},
        {"mode": "fedavg-lora", "upload-density": 0.1},
    ):
        with pytest.raises(SchemaError, match="upload_density must be in"):
            RunConfig.from_mapping(bad)
    with pytest.raises(SchemaError, match="temperature must be"):
        RunConfig.from_mapping({"temperature": 0})
    for bad in ({"max-wall-s": -1.0}, {"final-eval-size": -5}):
        with pytest.raises(SchemaError, match="must be >= 0"):
            RunConfig.from_mapping(bad)
    # each used to pass here and fail once the coordinator built its parts (18 s into `fedrl sim`),
    # or (stall_replies 0) to stop the run before its first reply
    for bad, message in (
        ({"max-staleness": -1}, "max_staleness must be >= 0, got -1$"),
        ({"alpha": -0.5}, "alpha must be >= 0, got -0.5$"),
        ({"clip-multiple": 0.5}, "clip_multiple must be 0 .off. or >= 1"),
        ({"robust": "mode"}, "robust must be mean, trimmed-mean or median"),
        ({"anchor-every": 0}, "anchor_every must be >= 1, got 0$"),
        ({"stall-replies": 0, "versions": -3}, "versions must be >= 1, got -3; stall_replies .* got 0$"),
        ({"schedule": "fifo"}, "schedule must be one of .'cyclic', 'random', 'lru'., got 'fifo'"),
        ({"base-steps": 0}, "1 <= min_steps <= base_steps <= max_steps"),
        ({"seed": -1}, "seed must be >= 0"),
        # a target over 1 stopped the run at its first eval; NaN passed `< 0` and was never reached
        ({"target-error": 2.0}, r"target_error is a held-out error, in \[0, 1\] \(0: off\); got 2.0$"),
        ({"target-error": float("nan")}, "target_error is a held-out error"),
        ({"max-time-s": float("nan")}, "max_time_s must be >= 0, got nan$"),
    ):
        with pytest.raises(SchemaError, match=message):
            RunConfig.from_mapping(bad)
    assert RunConfig.from_mapping({"robust": "median", "alpha": 0.0}).aggregation().robust == "median"
    # a model spec with a typo failed once the coordinator loaded it (17 s into `fedrl sim`)
    with pytest.raises(SchemaError, match="unknown model 'tiny-bsae': use tiny, tiny-gpt, tiny-base"):
        RunConfig.from_mapping({"model": "tiny-bsae"})
    # more blocks than the model has layers failed once the coordinator built them (22 s in)
    with pytest.raises(SchemaError, match="num_blocks=4, but tiny-base has 3 layers"):
        RunConfig.from_mapping({"num-blocks": 4})
    assert RunConfig.from_mapping({"num-blocks": 3}).num_blocks == 3
    # task parameters as `--set task_params='{...}'` or a TOML inline table give them: parsed, not text
    assert RunConfig.from_mapping({"task-params": {"length": 6}}).task_params == '{"length": 6}'


LEARNER_SETTINGS_THAT_CANNOT_TRAIN = [
    ({"lr": -1.0}, "lr must be a finite number > 0"),
    ({"lr": 0.0}, "lr must be a finite number > 0"),
    ({"lr": float("nan")}, "lr must be a finite number > 0"),
    ({"lora_alpha": 0.0}, "lora_alpha must be a finite number > 0"),
    ({"lora_rank": 0}, "lora_rank must be >= 1, got 0"),
    ({"prompts": 0}, "prompts must be >= 1, got 0"),
    ({"samples": -2}, "samples must be >= 1, got -2"),
    ({"method": "grpo"}, "method must be one of"),
    ({"task": "chess"}, "unknown task 'chess'"),
    ({"micro_batch": -1}, "micro_batch must be >= 0"),
    # the task is built from its parameters: these failed only once the coordinator made it, 17 s in
    ({"task_params": '{"length": -1}'}, "length must be >= 1, got -1"),
    ({"task_params": '{"lenght": 8}'}, "bad parameters for task 'reversal': .*'lenght'"),
    ({"task_params": "[8]"}, "task_params must be a JSON object"),
]


@pytest.mark.parametrize("bad, message", LEARNER_SETTINGS_THAT_CANNOT_TRAIN)
def test_settings_no_learner_can_train_with_are_refused_where_written_and_where_they_arrive(bad, message):
    """Before: `fedrl sim --set lr=-1` ran to its end with 207 client errors, 0 versions and exit 0
    (Adam refused the lr on every client, every round)."""
    with pytest.raises(SchemaError, match=message):
        RunConfig.parse(bad, "run config")
    with pytest.raises(SchemaError, match=message):
        TrainInstruction.parse(_instruction(**bad))
    with pytest.raises(SchemaError, match=message):  # what an invite carries
        LearnerSettings.parse({**LearnerSettings.of(RunConfig()), **bad})


def test_every_loss_a_message_may_name_exists():
    from fedrl.losses import LOSSES
    from fedrl.protocol import LOSS_NAMES

    assert set(LOSS_NAMES) == set(LOSSES)


def test_a_node_holds_v0_only_when_its_own_seeded_build_hashes_as_the_coordinators():
    from fedrl.clients.block_worker import ClientState, holding_origin
    from fedrl.patch import state_hash
    from fedrl.patch_chain import published

    initial = {"a": torch.randn(4, 3, generator=torch.Generator().manual_seed(0)), "b": torch.zeros(3, 2)}
    v0 = published(initial, "bfloat16")
    instr = TrainInstruction.parse(_instruction(wire_dtype="bfloat16", origin_hash=state_hash(v0)))
    held = holding_origin(ClientState(), initial, instr)
    assert held.held_version == 0 and state_hash(held.held) == state_hash(v0)
    assert all(t.dtype == torch.bfloat16 for t in held.held.values())
    # another dtype, another build, no claim, or a version already held: nothing is assumed
    assert holding_origin(ClientState(), initial, instr.replace(wire_dtype="float32")).held is None
    other = {**initial, "a": initial["a"] + 1e-3}
    assert holding_origin(ClientState(), other, instr).held is None
    assert holding_origin(ClientState(), initial, instr.replace(origin_hash="")).held is None
    kept = ClientState(held=published(other, "bfloat16"), held_version=4)
    assert holding_origin(kept, initial, instr) is kept
    with pytest.raises(SchemaError, match="wire_dtype must be one of"):
        TrainInstruction.parse(_instruction(wire_dtype="int8"))


def test_a_node_whose_cheapest_route_fails_reads_every_route_and_syncs_by_another():
    """A node asks the store for the cheapest route alone; when that patch does not verify it
    asks for every route and takes the next (here v1's anchor), on a real store."""
    from fedrl.clients.block_worker import ClientState, communicate
    from fedrl.clients.runtime import CommResult, Runtime
    from fedrl.credentials import ADMIN, new_secret, node_principal, token_for
    from fedrl.patch import encode_patch, state_hash
    from fedrl.patch_store import PatchStoreServer, StoreState
    from fedrl.signing import generate_signing_key, public_key_pem, sign_patch
    from fedrl.store_client import BlockingStoreClient

    secret, key = new_secret(), generate_signing_key()
    v0 = {"w": torch.randn(256, generator=torch.Generator().manual_seed(0)).bfloat16()}
    v1 = {"w": v0["w"].clone()}
    v1["w"].view(torch.int16)[::16] += 1
    server = PatchStoreServer(StoreState(secret)).start()
    try:
        admin = BlockingStoreClient(server.url, ADMIN, token_for(secret, ADMIN))
        skip = encode_patch(v0, v1, 0, 1)
        tampered = sign_patch(skip[:-40] + bytes(40), key)  # signed, but not the patch it claims to be
        anchor = sign_patch(encode_patch(None, v1, None, 1), key)
        refs = [
            {"base_version": None, "target_version": 1, "size": len(anchor), "key": admin.put(anchor)},
            {"base_version": 0, "target_version": 1, "size": len(tampered), "key": admin.put(tampered)},
        ]
        admin.publish({"latest": 1, "refs": refs, "public_key": public_key_pem(key).decode()})
        admin.close()
        principal = node_principal(1)
        instr = TrainInstruction.parse(
            _instruction(
                version=1,
                store_url=server.url,
                principal=principal,
                token=token_for(secret, principal),
                public_key=public_key_pem(key).decode(),
            )
        )
        result = CommResult()
        communicate(instr, ClientState(held=v0, held_version=0), None, "patch", result, Runtime())
    finally:
        server.stop()
    assert result.error is None and state_hash(result.held) == state_hash(v1)
    assert result.sync_patches == 1 and result.full_sync_bytes == len(anchor)
    # both patches were downloaded: the cheapest route, then the anchor it fell back to
    assert result.links[0].bytes_down > len(anchor) + len(tampered)


def test_an_instruction_travels_as_a_head_and_settings_the_node_keeps():
    from flwr.app import ConfigRecord, RecordDict

    from fedrl.clients.client_app import read_instruction
    from fedrl.protocol import ROUND_FIELDS, SETTINGS_UNKNOWN, join_instruction, split_instruction

    instr = TrainInstruction.parse(_instruction(round=3, client_id=2, data_shards=4))
    head, settings = split_instruction(instr)
    assert join_instruction(head, settings) == instr
    assert set(head.to_record()) == {*ROUND_FIELDS, "settings_id"} and not set(settings) & set(ROUND_FIELDS)
    later = split_instruction(instr.replace(round=4, version=9, block=1))[0].to_packed()
    assert later["s"][-1] == head.settings_id  # rounds change, the settings stay
    assert split_instruction(instr.replace(lr=0.5))[0].settings_id != head.settings_id

    state = RecordDict()
    first = RecordDict({"instruction": ConfigRecord(head.to_packed()), "settings": ConfigRecord(settings)})
    assert read_instruction(first, state) == instr
    assert read_instruction(RecordDict({"instruction": ConfigRecord(later)}), state).version == 9  # kept
    other = split_instruction(instr.replace(lr=0.5))[0].to_packed()
    with pytest.raises(ValueError, match=SETTINGS_UNKNOWN):
        read_instruction(RecordDict({"instruction": ConfigRecord(other)}), state)
    with pytest.raises(ValueError, match=SETTINGS_UNKNOWN):
        read_instruction(RecordDict({"instruction": ConfigRecord(later)}), RecordDict())  # a fresh node
