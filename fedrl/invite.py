"""An invitation to join a federation as a volunteer: one string (or a file holding it) the
operator hands out and `fedrl volunteer join` takes.

It carries where to connect (the SuperLink, the patch store), what to trust (the CA that signed
both servers' certificates), the credential that lets a volunteer enroll its node key and probe
its link (nothing else: `invite:<run>` in fedrl.credentials), and what the run trains, so the
volunteer's hardware probe measures the real learner step. The form is
`fedrl-invite:` + base64url(JSON); decoding checks every field and names what is wrong.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import time
from pathlib import Path

from cryptography import x509
from pydantic import model_validator

from fedrl import __version__
from fedrl.bounds import at_least
from fedrl.credentials import CredentialError, invite_principal, token_expires, token_for
from fedrl.protocol import LearnerSettings
from fedrl.schema import OTHER_VERSION, PROTOCOL, SchemaError

PREFIX = "fedrl-invite:"
# 3: dg_eta and ppo_clip among the learner settings; 2: the invite names the federation's protocol
VERSION = 3
RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
MAX_INVITE_CHARS = 64 << 10


class InviteError(ValueError):
    """An invite that cannot be used; the message says why."""


class Invite(LearnerSettings):
    version: int
    run: str  # the federation's name; the volunteer's files are kept under it
    superlink: str  # host:port of the SuperLink (Fleet API)
    store_url: str  # the patch store (https)
    ca_pem: str  # the CA certificate that signed the SuperLink's and the store's certificates
    token: str  # credential of principal invite:<run>; it expires (`fedrl invite --valid-days`)
    # the wire protocol of the operator's fedrl: a node of another one could not read its instructions
    protocol: int
    fedrl_version: str  # the operator's fedrl, for a volunteer who must install the same protocol
    # + LearnerSettings: what the run trains, for the probe (instructions decide the real work)

    @model_validator(mode="after")
    def _consistent(self):
        if self.protocol != PROTOCOL:
            raise ValueError(
                f"the federation speaks fedrl protocol {self.protocol} (fedrl {self.fedrl_version}), this "
                f"fedrl protocol {PROTOCOL} ({OTHER_VERSION}): pip install 'fedrl=={self.fedrl_version}'"
            )
        if not RUN_NAME.match(self.run):
            raise ValueError(f"run name {self.run!r} must be letters, digits, '.', '_' or '-'")
        host, _, port = self.superlink.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"superlink must be host:port, got {self.superlink!r}")
        try:
            token_expires(self.token)
        except CredentialError as err:
            raise ValueError(str(err)) from None
        if not self.store_url.startswith("https://"):
            raise ValueError(f"store_url must be https://, got {self.store_url!r}")
        try:
            x509.load_pem_x509_certificate(self.ca_pem.encode())
        except ValueError:
            raise ValueError("ca_pem is not a PEM certificate") from None
        at_least(self, 1, "num_blocks", "lora_rank", "prompts", "samples")
        return self

    def expired(self) -> str | None:
        """When the invite stopped enrolling keys, or None while it still does."""
        expires = token_expires(self.token)
        return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(expires)) if expires < time.time() else None

    @property
    def principal(self) -> str:
        return invite_principal(self.run)

    def encode(self) -> str:
        return PREFIX + base64.urlsafe_b64encode(self.model_dump_json().encode()).decode()


DEFAULT_VALID_DAYS = 30.0


def make_invite(
    run: str,
    superlink: str,
    store_url: str,
    ca_file: str | Path,
    secret: bytes,
    valid_days: float = DEFAULT_VALID_DAYS,
    **learner,
) -> Invite:
    """The operator's side (`fedrl invite`): `secret` is the patch store's; `learner` the run's
    LearnerSettings. The invite enrolls keys for `valid_days`; joined nodes use their own tokens."""
    try:
        ca_pem = Path(ca_file).read_text()
    except OSError as err:
        raise InviteError(f"cannot read the CA certificate {ca_file}: {err.strerror or err}") from None
    fields = dict(
        version=VERSION,
        run=run,
        superlink=superlink,
        store_url=store_url,
        ca_pem=ca_pem,
        protocol=PROTOCOL,
        fedrl_version=__version__,
        **learner,
    )
    if not valid_days > 0:
        raise InviteError(f"valid_days must be > 0, got {valid_days}")
    fields["token"] = token_for(secret, invite_principal(run), valid_days * 86400)
    try:
        return Invite.parse(fields, "invite")
    except SchemaError as err:
        raise InviteError(str(err)) from None


def load_invite(text_or_path: str) -> Invite:
    """An invite from its string or from a file holding it; InviteError says what is wrong."""
    text = text_or_path.strip()
    if not text.startswith(PREFIX):
        path = Path(text)
        try:
            if path.is_file():
                text = path.read_text()[:MAX_INVITE_CHARS].strip()
        except OSError as err:
            raise InviteError(f"cannot read the invite file {path}: {err.strerror or err}") from None
    if not text.startswith(PREFIX):
        raise InviteError(
            f"not a fedrl invite: expected a string starting with {PREFIX!r} or a file holding one, "
            f"got {text_or_path[:40]!r}"
        )
    try:
        data = json.loads(base64.urlsafe_b64decode(text.removeprefix(PREFIX).encode()))
    except (binascii.Error, ValueError, UnicodeDecodeError):
        raise InviteError("the invite is damaged (not base64url JSON): copy it again, whole") from None
    version = data.get("version") if isinstance(data, dict) else None
    if version != VERSION:  # before its fields, which another version names otherwise
        newer = isinstance(version, int) and version > VERSION
        raise InviteError(
            f"invite version {version!r}; this fedrl reads version {VERSION}: "
            + ("upgrade fedrl" if newer else "ask the operator for a new invite (`fedrl invite`)")
        )
    try:
        return Invite.parse(data, "invite")
    except SchemaError as err:
        raise InviteError(str(err)) from None
