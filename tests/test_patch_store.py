import asyncio
import hashlib
import json

import aiohttp
import pytest

from fedrl.credentials import ADMIN, new_secret, node_principal, sign_request, token_for
from fedrl.ledger import entry
from fedrl.patch_store import PatchStoreServer, StoreState
from fedrl.store_client import BlockingStoreClient, PatchStoreClient, StoreError


@pytest.fixture
def store():
    secret = new_secret()
    server = PatchStoreServer(StoreState(secret, max_object_bytes=1 << 20)).start()
    yield server, secret
    server.stop()


def client(server, secret, principal):
    return BlockingStoreClient(server.url, principal, token_for(secret, principal))


def test_put_get_and_uploader_binding(store):
    server, secret = store
    node = client(server, secret, node_principal(7))
    data = b"patch bytes" * 100
    digest = node.put(data)
    assert digest == hashlib.sha256(data).hexdigest()
    assert node.get(digest) == data
    admin = client(server, secret, ADMIN)
    assert admin.meta(digest) == {"size": len(data), "uploaders": ["node-7"]}
    other = client(server, secret, node_principal(8))
    assert other.put(data) == digest  # identical bytes from another node: bound to both
    assert admin.meta(digest)["uploaders"] == ["node-7", "node-8"]
    admin.delete(digest, "node-7")
    assert other.get(digest) == data  # node-8's upload is still there
    admin.delete(digest, "node-8")
    with pytest.raises(StoreError, match="404"):
        other.get(digest)
    for c in (node, other, admin):
        c.close()


def test_credentials_are_required_and_checked(store):
    server, secret = store
    forged = BlockingStoreClient(server.url, node_principal(7), token_for(secret, node_principal(8)))
    with pytest.raises(StoreError, match="403"):
        forged.put(b"x")
    stranger = BlockingStoreClient(
        server.url, node_principal(7), token_for(b"another secret", node_principal(7))
    )
    with pytest.raises(StoreError, match="403"):
        stranger.put(b"x")
    node = client(server, secret, node_principal(1))
    with pytest.raises(StoreError, match="403"):
        node.publish({"refs": []})  # only the coordinator publishes
    for c in (forged, stranger, node):
        c.close()


def test_bad_hash_oversize_and_unknown_objects_are_clear_http_errors(store):
    server, secret = store
    node = client(server, secret, node_principal(1))

    async def raw_put(name, body):
        async with PatchStoreClient(server.url, "node-1", token_for(secret, "node-1")) as c:
            url, headers = c._signed("PUT", f"/objects/{name}")
            async with c.session.put(url, data=body, headers=headers) as resp:
                return resp.status, await resp.text()

    status, text = asyncio.run(raw_put("0" * 64, b"not what the name says"))
    assert status == 400 and "does not hash" in text
    status, _ = asyncio.run(raw_put("not-a-digest", b"x"))
    assert status == 400
    big = b"\0" * (2 << 20)
    status, _ = asyncio.run(raw_put(hashlib.sha256(big).hexdigest(), big))
    assert status == 413
    with pytest.raises(StoreError, match="404"):
        node.get("f" * 64)
    node.close()


def test_catalog_publish_and_pruning(store):
    server, secret = store
    admin = client(server, secret, ADMIN)
    a, b = admin.put(b"anchor"), admin.put(b"delta")
    admin.publish(
        {
            "latest": 1,
            "refs": [
                {"base_version": None, "target_version": 0, "size": 6, "key": a},
                {"base_version": 0, "target_version": 1, "size": 5, "key": b},
            ],
        }
    )
    assert admin.catalog()["latest"] == 1
    admin.publish({"latest": 1, "refs": [{"base_version": 0, "target_version": 1, "size": 5, "key": b}]})
    with pytest.raises(StoreError, match="404"):
        admin.get(a)  # dropped from the catalog, so deleted
    with pytest.raises(StoreError, match="400"):
        admin.publish({"latest": 2, "refs": [{"target_version": 2, "key": "e" * 64}]})
    admin.close()


def test_standalone_service_with_tls(tmp_path):
    """`fedrl patch-store` as its own process, HTTPS with a certificate made by `cryptography`."""
    import datetime
    import socket
    import subprocess
    import sys
    import time

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    import ipaddress

    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False
        )
        .sign(key, hashes.SHA256())
    )
    (tmp_path / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "key.pem").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    secret = new_secret()
    (tmp_path / "secret").write_bytes(secret.hex().encode())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fedrl.cli",
            "patch-store",
            "--port",
            str(port),
            "--secret-file",
            str(tmp_path / "secret"),
            "--certfile",
            str(tmp_path / "cert.pem"),
            "--keyfile",
            str(tmp_path / "key.pem"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        shared = secret.hex().encode()
        url = f"https://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                c = BlockingStoreClient(
                    url,
                    node_principal(4),
                    token_for(shared, node_principal(4)),
                    ca_file=str(tmp_path / "cert.pem"),
                )
                digest = c.put(b"over tls")
                break
            except StoreError:
                c.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)
        assert c.get(digest) == b"over tls"
        c.close()
        plain = BlockingStoreClient(url, node_principal(4), token_for(shared, node_principal(4)))
        with pytest.raises(StoreError):  # the self-signed certificate is not trusted without the CA file
            plain.put(b"x")
        plain.close()
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_node_cannot_fill_the_store_for_everyone():
    """Each node has a quota, and nodes together may use only what the coordinator leaves them:
    one node filling the store used to make the next publish fail with 507 and end the run."""
    secret = new_secret()
    state = StoreState(secret, max_object_bytes=1 << 20, max_total_bytes=8 << 20, max_node_bytes=3 << 20)
    with PatchStoreServer(state) as server:
        hog, other, admin = (client(server, secret, p) for p in (node_principal(1), node_principal(2), ADMIN))
        try:
            for i in range(3):
                hog.put(bytes([i]) * (1 << 20))
            with pytest.raises(StoreError, match="507.*quota"):
                hog.put(b"one more" * 1000)
            for i in range(3):  # another node fills its own quota: nodes now hold 6 of 8 MiB
                other.put(bytes([100 + i]) * (1 << 20))
            third = client(server, secret, node_principal(3))
            with pytest.raises(StoreError, match="507.*reserved for the coordinator"):
                third.put(b"x" * (1 << 19))
            third.close()
            admin.put(b"a global patch" * 50_000)  # the coordinator still publishes
        finally:
            for c in (hog, other, admin):
                c.close()


def test_a_node_reads_only_its_own_uploads_and_the_coordinators_objects(store):
    """Free-riding: node-2 used to GET node-1's upload (reads needed no credential) and PUT the
    same bytes, so the store listed it as an uploader of node-1's delta."""

    server, secret = store
    honest, rider, admin = (client(server, secret, p) for p in (node_principal(1), node_principal(2), ADMIN))
    try:
        delta = honest.put(b"node-1's delta" * 100)
        with pytest.raises(StoreError, match="403"):
            rider.get(delta)
        with pytest.raises(StoreError, match="403"):
            rider.meta(delta)  # who uploaded what is the coordinator's business
        assert honest.get(delta) == b"node-1's delta" * 100 and admin.get(delta)
        published = admin.put(b"a global patch" * 100)
        ref = {"base_version": None, "target_version": 1, "size": 1400, "key": published}
        admin.publish({"latest": 1, "refs": [ref], "public_key": None})
        assert rider.get(published) == b"a global patch" * 100 and rider.catalog()["latest"] == 1
    finally:
        for c in (honest, rider, admin):
            c.close()

    async def anonymous(path):
        async with aiohttp.ClientSession() as session, session.get(server.url + path) as resp:
            return resp.status

    for path in (f"/objects/{delta}", f"/objects/{published}", f"/objects/{delta}/meta", "/catalog"):
        assert asyncio.run(anonymous(path)) == 401, path


def test_a_stalled_body_is_dropped_and_bodies_in_flight_are_bounded():
    """Uploads used to be read whole with no read timeout: held bodies grew the store without
    bound, and a body that stopped coming kept its handler open."""
    import socket
    import time

    secret = new_secret()
    state = StoreState(secret, max_object_bytes=1 << 20, max_receiving_bytes=1 << 20, upload_idle_s=5.0)
    with PatchStoreServer(state) as server:
        path = f"/objects/{'0' * 64}"
        signed = sign_request(node_principal(1), token_for(secret, node_principal(1)), "PUT", path)
        stalled = socket.create_connection((server.host, server.port), timeout=30)
        stalled.sendall(
            f"PUT {path} HTTP/1.1\r\nHost: store\r\n".encode()
            + "".join(f"{k}: {v}\r\n" for k, v in signed.items()).encode()
            + b"Content-Length: 900000\r\n\r\n"
            + b"x" * 800_000  # and then nothing
        )
        for _ in range(200):
            if state.receiving >= 800_000:
                break
            time.sleep(0.01)
        assert state.receiving == 800_000
        node = client(server, secret, node_principal(2))
        body = b"y" * 300_000
        with pytest.raises(StoreError, match="503"):
            node.put(body)  # past the bound on bodies in flight: refused at once, retry later
        reply = stalled.recv(4096)
        assert reply.startswith(b"HTTP/1.1 408") and b"sent nothing for 5 s after 800000 bytes" in reply
        stalled.close()
        assert state.receiving == 0
        assert node.put(body) == hashlib.sha256(body).hexdigest()
        node.close()


def test_captured_expired_or_altered_requests_are_refused(store):
    """Tokens used to be bearer strings that never expired: a captured request (or its token)
    opened the store for ever. Now each request is signed once, with a token that expires."""
    server, secret = store

    async def send(method, path, headers, body=None):
        async with aiohttp.ClientSession() as session:
            async with session.request(method, server.url + path, headers=headers, data=body) as resp:
                return resp.status, await resp.text()

    token = token_for(secret, node_principal(1))
    captured = sign_request(node_principal(1), token, "GET", "/catalog")
    assert asyncio.run(send("GET", "/catalog", captured))[0] == 200
    status, text = asyncio.run(send("GET", "/catalog", captured))
    assert status == 403 and "replayed" in text
    expired = sign_request(node_principal(1), token_for(secret, node_principal(1), -5), "GET", "/catalog")
    status, text = asyncio.run(send("GET", "/catalog", expired))
    assert status == 403 and "expired" in text
    status, text = asyncio.run(
        send("GET", "/health", sign_request(node_principal(1), token, "GET", "/catalog"))
    )
    assert status == 200  # health is open; the signature only opens what it names:
    status, text = asyncio.run(send("GET", "/enroll", sign_request(ADMIN, token, "GET", "/enroll")))
    assert status == 403 and "does not verify" in text  # a node's token is not the admin's
    admin_token = token_for(secret, ADMIN)
    body = json.dumps({"latest": None, "refs": []}).encode()
    swapped = sign_request(ADMIN, admin_token, "POST", "/catalog", body)
    status, text = asyncio.run(send("POST", "/catalog", swapped, b'{"latest": 9, "refs": []}'))
    assert status == 403 and "not the one" in text
    assert client(server, secret, ADMIN).catalog()["latest"] is None


def test_a_node_asks_for_the_refs_of_its_routes_and_bad_queries_or_refs_are_refused(store):
    server, secret = store
    admin, node = client(server, secret, ADMIN), client(server, secret, node_principal(3))
    keys = [admin.put(f"object {i}".encode()) for i in range(4)]
    refs = [
        {"base_version": None, "target_version": 0, "size": 900, "key": keys[0]},
        {"base_version": 0, "target_version": 1, "size": 50, "key": keys[1]},
        {"base_version": 1, "target_version": 2, "size": 50, "key": keys[2]},
        {"base_version": 0, "target_version": 2, "size": 60, "key": keys[3]},
    ]
    admin.publish({"latest": 2, "refs": refs, "public_key": "pem"})
    assert node.catalog()["refs"] == refs  # no target: the whole catalog
    answer = node.catalog(target=2, held=0)
    assert answer["refs"] == [refs[0], refs[3]]  # the skip; anchor + skip
    assert set(answer) == {"refs", "full_sync_bytes"}  # what the routes decide, nothing that moves
    assert node.catalog(target=2)["refs"] == [refs[0], refs[3]]
    assert node.catalog(target=1, held=0)["refs"] == [refs[0], refs[1]]
    assert node.catalog(target=7, held=0)["refs"] == []
    first = node.catalog(target=2, held=0, plans=1)
    assert (
        first["refs"] == [refs[3]] and first["full_sync_bytes"] == 960
    )  # the skip alone; v0's anchor + skip

    async def raw_get(query):
        async with PatchStoreClient(server.url, "node-3", token_for(secret, "node-3")) as c:
            url, headers = c._signed("GET", f"/catalog?{query}")
            async with c.session.get(url, headers=headers) as resp:
                return resp.status, await resp.text()

    for query in (
        "target=-1",
        "target=x",
        "target=1&held=1.5",
        "target=²",
        "target=" + "9" * 30,
        "target=2&plans=-1",
    ):
        status, text = asyncio.run(raw_get(query))
        assert status == 400 and "whole number" in text, (query, status, text)
    status, text = asyncio.run(raw_get("target=2&plans=0"))
    assert status == 400 and "at least 1" in text
    for bad in (
        {"base_version": 0, "target_version": 1, "key": keys[1]},  # no size
        {"base_version": "0", "target_version": 1, "size": 5, "key": keys[1]},
        {"base_version": 0, "target_version": 1, "size": -5, "key": keys[1]},
        {"base_version": 0, "target_version": True, "size": 5, "key": keys[1]},
        {"base_version": 0, "target_version": 1, "size": 5, "key": keys[1], "extra": 1},
    ):
        with pytest.raises(StoreError, match="400.*base_version, target_version, size, key"):
            admin.publish({"latest": 2, "refs": [bad]})
    assert node.catalog()["refs"] == refs  # a refused catalog changed nothing
    admin.close()
    node.close()


def test_each_node_reads_its_own_ledger_row_and_only_the_coordinator_writes_them(store):
    server, secret = store
    admin = client(server, secret, ADMIN)
    mine, other = client(server, secret, node_principal(3)), client(server, secret, node_principal(4))
    assert mine.ledger() is None  # nothing published yet
    row = entry() | {"client": 0, "replies": 2, "accepted": 1, "refused": {"norm": 1}, "samples": 64}
    admin.publish_ledger({node_principal(3): row})
    assert mine.ledger() == row and other.ledger() is None  # no one else's row
    admin.publish_ledger({node_principal(4): {**row, "client": 1}})  # rows that changed, merged
    assert mine.ledger() == row and other.ledger()["client"] == 1
    with pytest.raises(StoreError, match="403"):
        mine.publish_ledger({node_principal(3): {**row, "accepted": 99}})  # a node cannot credit itself
    for bad in ([row], {"admin": row}, {node_principal(3): 5}):
        with pytest.raises(StoreError, match="400"):
            admin.publish_ledger(bad)
    with pytest.raises(StoreError, match="403"):  # an invite's credential opens enrollment alone
        client(server, secret, "invite:r").ledger()
    assert mine.ledger() == row  # nothing refused changed it
