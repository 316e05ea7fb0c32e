"""Ed25519 signatures on patches: receivers that hold the coordinator's public key accept
only patches it signed. Envelope: b"FRLS" | 64-byte signature | patch bytes."""

from __future__ import annotations

from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from fedrl.patch import PatchError

SIGNED_MAGIC = b"FRLS"
SIGNATURE_BYTES = 64


class UnsignedPatch(PatchError):
    pass


class ForgedPatch(PatchError):
    pass


def generate_signing_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def sign_patch(patch: bytes, key: Ed25519PrivateKey) -> bytes:
    return SIGNED_MAGIC + key.sign(patch) + patch


def verify_signed_patch(data: bytes, public_key: Ed25519PublicKey) -> bytes:
    """The patch inside a signed envelope, or UnsignedPatch / ForgedPatch."""
    if data[:4] != SIGNED_MAGIC or len(data) < 4 + SIGNATURE_BYTES:
        raise UnsignedPatch("patch is not signed, and this receiver only accepts signed patches")
    signature, patch = data[4 : 4 + SIGNATURE_BYTES], data[4 + SIGNATURE_BYTES :]
    try:
        public_key.verify(signature, patch)
    except InvalidSignature:
        raise ForgedPatch("patch signature does not verify with the coordinator's public key") from None
    return patch


def save_private_key(key: Ed25519PrivateKey, path: str | Path) -> None:
    path = Path(path)
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    path.chmod(0o600)


def load_private_key(path: str | Path) -> Ed25519PrivateKey:
    key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{path} is not an Ed25519 private key")
    return key


def public_key_pem(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def load_public_key(pem: bytes) -> Ed25519PublicKey:
    key = serialization.load_pem_public_key(pem)
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError("not an Ed25519 public key")
    return key
