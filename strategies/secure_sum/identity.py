"""Who a secure-sum client is: a long-term signing key bound to a silo, and the silos it trusts.

Against a server that deviates, a client must know that the public keys it is sent were made by
real silos, and that the survivor set it is asked to unmask for is the one every survivor saw
(SecAgg's active-adversary variant, Bonawitz et al. 2017 §6; Bell et al. 2020 for SecAgg+). That
needs a PKI: each silo signs with a key bound to its identity, and each silo holds the public keys
of the silos it agreed to aggregate with. Here:

* :class:`SiloIdentity` is the silo's private signing key: an OpenSSH or PEM file, EC (the key a
  SuperNode authenticates with, ``flower-supernode --auth-supernode-private-key``) or Ed25519.
  Signatures use Flower's primitives (``flwr.supercore.primitives``).
* :class:`TrustedSilos` is the operator's file of the other silos' public keys, one OpenSSH public
  key per line (the ``.pub`` files a SuperLink registers), ``#`` comments allowed.

Flower-free; the ClientApp loads both from its node config (``silo-signing-key``, ``secagg-peers``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519


class IdentityError(ValueError):
    """A key file that cannot be used, with the reason in one line."""


def _public_text(public_key) -> str:
    """A public key as its OpenSSH line without comment ("ecdsa-sha2-nistp384 AAAA...")."""
    return public_key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()


def _sign(private_key, message: bytes) -> bytes:
    if isinstance(private_key, ed25519.Ed25519PrivateKey):
        from flwr.supercore.primitives.asymmetric_ed25519 import sign_message
    else:
        from flwr.supercore.primitives.asymmetric import sign_message
    return sign_message(private_key, message)


def _verify(public_key, message: bytes, signature: bytes) -> bool:
    try:
        if isinstance(public_key, ed25519.Ed25519PublicKey):
            public_key.verify(signature, message)
            return True
        from cryptography.hazmat.primitives import hashes

        public_key.verify(signature, message, ec.ECDSA(hashes.SHA256()))
        return True
    except (InvalidSignature, ValueError, TypeError):
        return False


def _load_private(data: bytes, path) -> object:
    errors = []
    for loader in (serialization.load_ssh_private_key, serialization.load_pem_private_key):
        try:
            key = loader(data, password=None)
        except (ValueError, TypeError) as exc:
            errors.append(str(exc))
            continue
        if not isinstance(key, (ec.EllipticCurvePrivateKey, ed25519.Ed25519PrivateKey)):
            raise IdentityError(f"signing key {path}: an EC or Ed25519 key is needed, got {type(key).__name__}")
        return key
    raise IdentityError(f"signing key {path} is neither an OpenSSH nor an unencrypted PEM private key")


@dataclass(frozen=True)
class SiloIdentity:
    """A silo's long-term signing key."""

    private_key: object

    @classmethod
    def from_file(cls, path) -> "SiloIdentity":
        path = Path(path).expanduser()
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise IdentityError(f"signing key {path} cannot be read ({exc.strerror or exc})") from None
        return cls(_load_private(data, path))

    @classmethod
    def generate(cls) -> "SiloIdentity":
        """A fresh EC P-384 key, as a SuperNode's authentication key (tests, examples)."""
        return cls(ec.generate_private_key(ec.SECP384R1()))

    @property
    def public(self) -> str:
        return _public_text(self.private_key.public_key())

    def public_line(self, comment: str = "") -> str:
        """The line another silo puts in its ``secagg-peers`` file."""
        return (self.public + (" " + comment if comment else "")).strip()

    def sign(self, message: bytes) -> bytes:
        return _sign(self.private_key, message)


class TrustedSilos:
    """The public keys of the silos this silo agreed to aggregate with (and its own)."""

    def __init__(self, public_keys) -> None:
        self._keys = {}
        for text in public_keys:
            key = _parse_public(text)
            self._keys[_public_text(key)] = key

    @classmethod
    def from_file(cls, path) -> "TrustedSilos":
        path = Path(path).expanduser()
        try:
            lines = path.read_text().splitlines()
        except OSError as exc:
            raise IdentityError(f"secagg-peers file {path} cannot be read ({exc.strerror or exc})") from None
        keys = []
        for number, line in enumerate(lines, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            try:
                keys.append(_parse_public(line))
            except IdentityError as exc:
                raise IdentityError(f"secagg-peers file {path}, line {number}: {exc}") from None
        if not keys:
            raise IdentityError(f"secagg-peers file {path} lists no public key")
        return cls([_public_text(k) for k in keys])

    def __contains__(self, public: str) -> bool:
        return _canonical(public) in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def verify(self, public: str, message: bytes, signature: bytes) -> bool:
        """Is ``signature`` a valid signature of ``message`` by the trusted silo ``public``?"""
        key = self._keys.get(_canonical(public))
        return key is not None and isinstance(signature, (bytes, bytearray)) and _verify(key, message, bytes(signature))


def _canonical(public: str) -> str:
    parts = str(public).split()
    return " ".join(parts[:2])


def _parse_public(text: str):
    try:
        key = serialization.load_ssh_public_key(" ".join(str(text).split()[:2]).encode())
    except (ValueError, TypeError, IndexError):
        raise IdentityError("not an OpenSSH public key line") from None
    if not isinstance(key, (ec.EllipticCurvePublicKey, ed25519.Ed25519PublicKey)):
        raise IdentityError(f"an EC or Ed25519 public key is needed, got {type(key).__name__}")
    return key


def digest(*parts) -> bytes:
    """A domain-separated SHA-256 of a message's parts (what is signed)."""
    h = hashlib.sha256(b"fedpower-secure-sum/v1")
    for part in parts:
        data = part if isinstance(part, (bytes, bytearray)) else str(part).encode()
        h.update(len(data).to_bytes(8, "big"))
        h.update(bytes(data))
    return h.digest()
