"""Certificates and keys for a deployment, made with `cryptography` (`fedrl certs`).

One folder holds everything a deployment needs:
  ca.pem / ca.key              the deployment's own certificate authority (EC P-384)
  server.pem / server.key      the TLS certificate of the SuperLink and the patch store,
                               valid for the names and addresses given (127.0.0.1, localhost, ...)
  nodes/NAME.key / NAME.pub    each SuperNode's authentication key pair: EC P-384, the private
                               key in OpenSSH PEM and the public key in OpenSSH form, which is
                               what `flower-supernode --auth-supernode-private-key` and
                               `flwr supernode register` take
  store.secret                 the patch store's secret, shared with the coordinator
Existing files are kept (making certificates is idempotent), so a re-run only adds what is missing.
"""

from __future__ import annotations

import datetime
import ipaddress
import re
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedrl.credentials import load_or_create_secret, write_private

NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
VALID_DAYS = 825


def _write(path: Path, data: bytes, private: bool) -> None:
    write_private(path, data)
    if not private:
        path.chmod(0o644)


def _key_pem(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedrl deployment"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def load_pem_certificate(path: Path) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(path.read_bytes())
    except ValueError as err:
        raise ValueError(f"{path} is not a PEM certificate: {err}") from None


def load_pem_key(path: Path):
    try:
        return serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{path} is not an unencrypted PEM private key: {err}") from None


def make_ca(directory: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert_path, key_path = directory / "ca.pem", directory / "ca.key"
    if cert_path.exists() and key_path.exists():
        return load_pem_certificate(cert_path), load_pem_key(key_path)
    key = ec.generate_private_key(ec.SECP384R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("fedrl CA"))
        .issuer_name(_name("fedrl CA"))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        .sign(key, hashes.SHA384())
    )
    _write(key_path, _key_pem(key), private=True)
    _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), private=False)
    return cert, key


def make_server_cert(directory: Path, hosts: list[str]) -> None:
    """server.pem/server.key for `hosts`; remade when the existing one lacks a host."""
    cert_path, key_path = directory / "server.pem", directory / "server.key"
    if cert_path.exists() and key_path.exists():
        names = load_pem_certificate(cert_path).extensions.get_extension_for_class(
            x509.SubjectAlternativeName
        )
        if {_san(h) for h in hosts} <= set(names.value):
            return
    ca_cert, ca_key = make_ca(directory)
    key = ec.generate_private_key(ec.SECP384R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(hosts[0]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA384())
    )
    _write(key_path, _key_pem(key), private=True)
    _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), private=False)


def make_node_key(directory: Path, name: str) -> tuple[Path, Path]:
    """nodes/NAME.key (OpenSSH private key) and nodes/NAME.pub (OpenSSH public key), EC P-384."""
    if not NODE_NAME.match(name):
        raise ValueError(f"node name {name!r}: use letters, digits, '.', '_' or '-' (at most 64)")
    key_path, pub_path = directory / "nodes" / f"{name}.key", directory / "nodes" / f"{name}.pub"
    if key_path.exists() and pub_path.exists():
        return key_path, pub_path
    key = ec.generate_private_key(ec.SECP384R1())
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    )
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    _write(key_path, private, private=True)
    _write(pub_path, public + b"\n", private=False)
    return key_path, pub_path


def make_deployment_credentials(
    directory: str | Path, hosts: list[str] | None = None, nodes: list[str] | None = None
) -> Path:
    """Everything `fedrl certs` makes (see the module docstring); returns the folder."""
    directory = Path(directory)
    make_ca(directory)
    make_server_cert(directory, hosts or ["127.0.0.1", "localhost"])
    for name in nodes or []:
        make_node_key(directory, name)
    load_or_create_secret(directory / "store.secret")
    return directory
