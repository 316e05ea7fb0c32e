"""The operator's side of volunteer enrollment (`fedrl approve`, and a thread of
`fedrl deploy local --volunteers`).

A volunteer enrolls its node's public key with the patch store using its invite's credential
(fedrl.invite). The approver, holding the store's admin credential and the `flwr` CLI's
connection to the SuperLink, registers every pending key with the SuperLink (Flower's
SuperNode authentication) and marks it approved; a key that cannot be registered is marked
refused with the reason. A key the operator later unregisters (`flwr supernode unregister`)
stays approved in the store but is refused by the SuperLink: the volunteer says so.
"""

from __future__ import annotations

import threading
from pathlib import Path

from fedrl.credentials import ADMIN, token_source
from fedrl.deploy.federation import DeployError, Federation
from fedrl.store_client import BlockingStoreClient, StoreError


class Approver:
    def __init__(self, federation: Federation, store_url: str, secret: bytes, ca_file: str, keys_dir: Path):
        self.federation, self.keys_dir = federation, Path(keys_dir)
        self.store = BlockingStoreClient(store_url, ADMIN, token_source(secret), ca_file=ca_file)
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None

    def approve_pending(self) -> list[str]:
        """Register every pending key; the fingerprints approved."""
        approved = []
        for entry in self.store.enrollments():
            if entry["status"] != "pending":
                continue
            fingerprint = entry["fingerprint"]
            path = self.keys_dir / f"{fingerprint[:32]}.pub"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(entry["public_key"] + "\n")
            try:
                self.federation.register(path)
            except DeployError as err:
                self.store.decide(fingerprint, "refused", f"the SuperLink would not register it: {err}")
                continue
            self.store.decide(fingerprint, "approved")
            approved.append(fingerprint)
        return approved

    def run(self, every_s: float = 1.0, say=print) -> None:
        """Approve until stopped; a store or SuperLink that is briefly away is waited for."""
        while not self.stop_event.wait(every_s):
            try:
                for fingerprint in self.approve_pending():
                    say(f"approved volunteer key {fingerprint[:16]}")
            except (StoreError, DeployError) as err:
                say(f"approver: {err}; retrying")

    def start(self, say=print) -> Approver:
        self.thread = threading.Thread(target=self.run, kwargs={"say": say}, name="approver", daemon=True)
        self.thread.start()
        return self

    def close(self) -> None:
        self.stop_event.set()
        if self.thread is not None:
            self.thread.join(30)
        self.store.close()
