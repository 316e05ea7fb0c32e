"""`fedrl bench pulse` on a short real trajectory: what it reports is what the codec did."""

import numpy as np
import torch

from fedrl.bench.pulse import bf16_trajectory, chain_speed, measure, sparse_summary, table
from fedrl.models import load_model
from fedrl.patch import encode_patch, read_header, to_bits
from fedrl.tasks import ReversalTask


def test_pulse_rows_match_the_patches_they_describe():
    torch.set_num_threads(1)
    lm = load_model("tiny-base")
    traj = bf16_trajectory(
        lm, ReversalTask(length=8), dict(lm.model.named_parameters()), 1e-3, 4, 4, 4, 0, "t"
    )
    case = measure("tiny-full", 1e-3, 1, traj, level=1, timed=True)
    assert case["pairs"] >= 2 and case["bit_identical"]
    numel = sum(t.numel() for t in traj[0].values())
    for pair in case["per_pair"]:
        a, b = pair["from"], pair["to"]
        patch = encode_patch(traj[a], traj[b], a, b, level=1)
        changed = sum(int(np.count_nonzero(to_bits(traj[a][n]) != to_bits(traj[b][n]))) for n in traj[a])
        assert pair["ratio"] == case["dense_bytes"] / len(patch)
        assert pair["sparsity"] == 1 - changed / numel
        assert pair["bits_per_change"] == 8 * len(patch) / changed
        assert pair["tiered_tensors"] == sum(e["mode"] == "tiered" for e in read_header(patch).tensors)
        speeds = ("encode_mb_s", "decode_mb_s", "link_decode_mb_s", "memcpy_mb_s")
        assert all(pair[key] > 0 for key in speeds)
    assert "tiny-full" in table([case])
    chain = chain_speed("tiny-full", 1e-3, traj, level=1, repeats=1)  # it checks the state it reached
    assert chain["links"] == 4 and chain["sync_ms"] > 0 and chain["copying_ms"] > 0
    assert sparse_summary([case], at_least=0.0).startswith("tiny-full:")
