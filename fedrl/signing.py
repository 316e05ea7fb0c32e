"""Ed25519 signatures on patches: receivers that hold the coordinator's public key accept
only patches it signed. Envelope: b"FRLS" | 64-byte signature | patch bytes."""

from __future__ import annotations

import hashlib
from pathlib import Path

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from fedrl.credentials import write_private
from fedrl.patch_errors import PatchError

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
    write_private(
        Path(path),
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
    )


def load_private_key(path: str | Path) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except OSError as err:
        raise ValueError(f"cannot read the signing key {path}: {err.strerror or err}") from None
    except (ValueError, TypeError) as err:
        raise ValueError(f"{path} is not an unencrypted PEM private key: {err}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{path} is not an Ed25519 private key")
    return key


def load_or_create_signing_key(path: str | Path) -> Ed25519PrivateKey:
    """The coordinator's key, made the first time and read back on every restart, so clients
    that pinned it keep trusting the restarted coordinator."""
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        save_private_key(generate_signing_key(), path)
    return load_private_key(path)


def key_fingerprint(public_pem: str | bytes) -> str:
    """A short, stable name of a public key (SHA-256 of its DER form)."""
    der = load_public_key(public_pem.encode() if isinstance(public_pem, str) else public_pem).public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return hashlib.sha256(der).hexdigest()


def key_fingerprint_ssh(public_key: str) -> str:
    """The same kind of name for an OpenSSH public key line (a SuperNode's); ValueError when the
    line is not one."""
    if not isinstance(public_key, str) or len(public_key) > 4096:
        raise ValueError("not an OpenSSH public key line")
    try:
        key = serialization.load_ssh_public_key(public_key.strip().encode())
    except UnsupportedAlgorithm as err:
        raise ValueError(f"unsupported key type: {err}") from None
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).hexdigest()


def public_key_pem(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def load_public_key(pem: bytes) -> Ed25519PublicKey:
    key = serialization.load_pem_public_key(pem)
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError("not an Ed25519 public key")
    return key
