"""What a real node knows about itself, from `flower-supernode --node-config`:

  ca-file        the CA certificate that signed the patch store's TLS certificate (https stores)
  state-dir      where the node keeps what must outlive its process: the coordinator key it
                 pinned, its client state, status and probe (fedrl.node_files)
  max-threads    CPU threads the learner may use (0: torch's default)
  upload-kbps    caps on the node's link to the patch store, kbit/s (0: none)
  download-kbps

And the pin itself: the first coordinator key a node sees for a patch store is the only one it
trusts for that store afterwards. A restarted coordinator reads its key back from its state
directory, so its clients go on; a different key is refused with the reason, before anything
signed by it is applied.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import model_validator

from fedrl.bounds import at_least
from fedrl.credentials import write_private
from fedrl.schema import Schema
from fedrl.signing import key_fingerprint

PINS_FILE = "coordinator-keys.json"


class KeyChanged(ValueError):
    """The coordinator's key is not the one this node pinned."""


class NodeSettings(Schema):
    ca_file: str = ""
    state_dir: str = ""
    max_threads: int = 0
    upload_kbps: float = 0.0
    download_kbps: float = 0.0

    @model_validator(mode="after")
    def _consistent(self):
        if self.ca_file and not Path(self.ca_file).is_file():
            raise ValueError(f"ca-file {self.ca_file!r} is not a readable file on this node")
        at_least(self, 0, "max_threads", "upload_kbps", "download_kbps", label=lambda n: n.replace("_", "-"))
        return self

    def cap_bytes_s(self, kbps: float) -> float:
        return kbps * 1000 / 8 if kbps else float("inf")

    @classmethod
    def from_node_config(cls, node_config: Mapping[str, Any]) -> NodeSettings:
        """Only fedrl's keys; Flower's own (partition-id, ...) are left alone."""
        mine = {k.replace("-", "_"): v for k, v in node_config.items()}
        return cls.parse({k: v for k, v in mine.items() if k in cls.model_fields}, "node config")


def check_pin(pins: dict[str, str], store_url: str, public_key_pem: str) -> dict[str, str]:
    """Pins with this store's key added on first sight; KeyChanged when it differs from the pin."""
    fingerprint = key_fingerprint(public_key_pem)
    pinned = pins.get(store_url)
    if pinned is not None and pinned != fingerprint:
        raise KeyChanged(
            f"refused: the coordinator key for {store_url} is {fingerprint[:16]}..., but this node "
            f"pinned {pinned[:16]}... when it first joined; remove the pin from the node's state-dir "
            "only if the operator really replaced the key"
        )
    return {**pins, store_url: fingerprint}


def load_pins(state_dir: str) -> dict[str, str]:
    if not state_dir:
        return {}
    path = Path(state_dir) / PINS_FILE
    try:
        pins = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        raise ValueError(f"pinned keys in {path} cannot be read: {err}") from None
    if not isinstance(pins, dict) or not all(isinstance(v, str) for v in pins.values()):
        raise ValueError(f"pinned keys in {path} are not a table of store URL to fingerprint")
    return pins


def save_pins(state_dir: str, pins: dict[str, str]) -> None:
    if state_dir:
        write_private(Path(state_dir) / PINS_FILE, json.dumps(pins, indent=1).encode())
