from fedrl.strategies.reputation import Reputation


def test_refusals_a_client_controls_cost_it_weight_and_lateness_does_not():
    r = Reputation()
    assert r.weight(0) == 0.5  # unknown: half of what a long honest record earns
    for _ in range(8):
        r.record(0, accepted=True)
        r.record(1, accepted=False, cause="gate")
        r.record(2, accepted=False, cause="staleness")
    assert r.weight(0) == 0.9 and r.weight(1) == 0.1 and r.weight(2) == 0.5
    restored = Reputation()
    restored.load_state_dict({k: {str(c): n for c, n in v.items()} for k, v in r.state_dict().items()})
    assert [restored.weight(c) for c in range(3)] == [r.weight(c) for c in range(3)]
