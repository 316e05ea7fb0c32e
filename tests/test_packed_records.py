"""Messages sent every round travel packed (fields by position behind a layout id): they must come
back exactly through Flower's own serialization, cost less than their named form, and refuse a
record of another layout or shape with a clear SchemaError."""

import hashlib

import pytest
from fake_grid import at_protocol
from flwr.app import ConfigRecord
from flwr.common.serde import config_record_from_proto, config_record_to_proto
from hypothesis import given
from hypothesis import strategies as st

from fedrl.protocol import InstructionHead, TrainReport
from fedrl.schema import OTHER_VERSION, PROTOCOL, SchemaError

finite = st.floats(min_value=0, max_value=1e12, allow_nan=False)
counts = st.integers(min_value=0, max_value=2**40)
reports = st.builds(
    TrainReport,
    upload_key=st.sampled_from(["", hashlib.sha256(b"x").hexdigest()]),
    upload_block=st.integers(-2, 64),
    upload_base_version=st.integers(-1, 10**6),
    upload_samples=counts,
    synced_version=counts,
    reward=st.floats(allow_nan=False, allow_infinity=False),
    loss=st.floats(allow_nan=False, allow_infinity=False),
    gate_mean=st.floats(0, 1),
    steps=counts,
    compute_s=finite,
    comm_s=finite,
    overlap_s=finite,
    duration_s=finite,
    bytes_up=counts,
    bytes_down=counts,
    staleness=st.integers(0, 100),
    link_bytes_per_s=finite,
    memory_mb=finite,
    full_sync_bytes=counts,
    sync_patches=counts,
    leaving=st.sampled_from(["", "after-flush", "now"]),
)


def over_the_wire(record: dict) -> dict:
    return dict(config_record_from_proto(config_record_to_proto(ConfigRecord(record))))


@given(reports)
def test_a_report_comes_back_exactly_and_smaller_than_named(report):
    packed = report.to_packed()
    assert TrainReport.from_packed(over_the_wire(packed)) == report
    named = config_record_to_proto(ConfigRecord(report.to_record())).ByteSize()
    assert config_record_to_proto(ConfigRecord(packed)).ByteSize() < 0.5 * named


def test_an_instruction_head_comes_back_exactly():
    head = InstructionHead(
        action="train",
        block=2,
        steps=64,
        version=9,
        round=3,
        seed=7,
        client_id=4,
        settings_id="ab" * 8,
        rest_s=2.5,
    )
    assert InstructionHead.from_packed(over_the_wire(head.to_packed())) == head


REPORT = TrainReport.parse(
    dict(
        upload_key="", upload_block=-2, upload_base_version=-1, upload_samples=0, synced_version=3,
        reward=0.5, loss=0.1, gate_mean=0.5, steps=4, compute_s=1.0, comm_s=0.1, overlap_s=0.1,
        duration_s=1.0, bytes_up=0, bytes_down=10, staleness=0, link_bytes_per_s=1.0, memory_mb=1.0,
    )
)  # fmt: skip


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda r: {**r, "layout": f"{PROTOCOL}.00000000"}, f"layout '{PROTOCOL}.00000000' is not"),
        (lambda r: {k: v for k, v in r.items() if k != "layout"}, "layout None is not"),
        (lambda r: {**r, "i": r["i"][:-1]}, "too few values"),
        (lambda r: {**r, "f": [*r["f"], 1.0]}, "more values than layout"),
        (lambda r: {**r, "x": [1]}, "more values than layout"),
        (lambda r: {**r, "s": "abc"}, "groups are lists"),
        (lambda r: {**r, "i": [1.5, *r["i"][1:]]}, "Input should be a valid integer"),
        (lambda r: {**r, "i": [*r["i"][:-1], -5]}, "must be >= 0"),
    ],
)
def test_a_record_of_another_layout_or_shape_is_refused_by_name(change, message):
    with pytest.raises(SchemaError, match=message):
        TrainReport.from_packed(change(REPORT.to_packed()), "report")


def test_a_named_record_is_not_taken_for_a_packed_one():
    with pytest.raises(SchemaError, match="another fedrl version"):
        TrainReport.from_packed(REPORT.to_record())
    with pytest.raises(SchemaError, match="got 'list'"):
        TrainReport.unpack([1, 2])  # type: ignore[arg-type]


@pytest.mark.parametrize("peer", [PROTOCOL - 1, PROTOCOL + 1])
def test_a_record_of_another_protocol_is_refused_naming_both(peer):
    """Two fedrl versions whose messages mean different things refuse each other by name, even
    where the fields are the same (the layout id carries the protocol)."""
    with pytest.raises(SchemaError) as refused:
        TrainReport.from_packed(at_protocol(REPORT.to_packed(), peer), "report")
    assert f"the peer speaks fedrl protocol {peer}, this fedrl protocol {PROTOCOL}" in str(refused.value)
    assert OTHER_VERSION in str(refused.value)


def test_a_record_from_before_protocol_numbers_is_refused_as_such():
    """Protocol 1's layout ids were 8 hex digits (the same fields hashed, no number in front)."""
    old = REPORT.layout().partition(".")[2]
    with pytest.raises(SchemaError, match=f"layout '{old}' is from a fedrl before protocol numbers"):
        TrainReport.from_packed({**REPORT.to_packed(), "layout": old}, "report")


def test_a_field_of_the_settings_an_instruction_head_goes_with_is_in_the_heads_layout(monkeypatch):
    """The settings travel by name, once: a node that would not know one of their fields refuses
    the head itself, by its layout, as another fedrl version (not a missing field later)."""
    import fedrl.protocol

    class Newer(fedrl.protocol.TrainInstruction):
        a_new_setting: int = 0

    before = InstructionHead.layout()
    monkeypatch.setattr(fedrl.protocol, "TrainInstruction", Newer)
    assert InstructionHead.layout() != before and InstructionHead.layout().startswith(f"{PROTOCOL}.")
