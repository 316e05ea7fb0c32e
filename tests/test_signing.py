import pytest
import torch

from fedrl.patch import apply_patch, encode_patch
from fedrl.signing import (
    ForgedPatch,
    UnsignedPatch,
    generate_signing_key,
    load_private_key,
    load_public_key,
    public_key_pem,
    save_private_key,
    sign_patch,
    verify_signed_patch,
)


def test_signed_patch_verifies_and_applies(tmp_path):
    key = generate_signing_key()
    save_private_key(key, tmp_path / "coord.pem")
    key = load_private_key(tmp_path / "coord.pem")
    public = load_public_key(public_key_pem(key))
    new = {"w": torch.randn(10).bfloat16()}
    patch = encode_patch(None, new, None, 1)
    assert torch.equal(apply_patch(None, verify_signed_patch(sign_patch(patch, key), public))["w"], new["w"])


def test_unsigned_and_forged_patches_are_rejected():
    key, intruder = generate_signing_key(), generate_signing_key()
    public = key.public_key()
    patch = encode_patch(None, {"w": torch.zeros(4)}, None, 1)
    with pytest.raises(UnsignedPatch):
        verify_signed_patch(patch, public)
    with pytest.raises(ForgedPatch):
        verify_signed_patch(sign_patch(patch, intruder), public)
    signed = bytearray(sign_patch(patch, key))
    signed[-1] ^= 1
    with pytest.raises(ForgedPatch):
        verify_signed_patch(bytes(signed), public)
