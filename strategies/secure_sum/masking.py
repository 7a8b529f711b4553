"""The cryptographic pieces of SecAgg+ (Bell et al. 2020): key agreement, the mask generator, the
sparse neighbour graph and Shamir shares. No Flower protocol code, only Flower's primitives:

* key pairs: ``flwr.supercore.primitives.asymmetric`` (ECDH on NIST P-384, PEM bytes);
* shared keys: ``flwr.common.secure_aggregation.crypto.symmetric_encryption.generate_shared_key``
  (ECDH then HKDF-SHA256 to 32 bytes), and its Fernet ``encrypt`` / ``decrypt`` for the shares;
* Shamir: ``flwr.common.secure_aggregation.crypto.shamir`` (GF(2^128), 16-byte chunks);
* share packing: ``flwr.common.secure_aggregation.secaggplus_utils.share_keys_plaintext_concat``.

The mask generator is ours: ``flwr``'s ``pseudo_rand_gen`` seeds numpy's ``RandomState`` with a
32-bit XOR of the seed (a mask found by 2^32 trials) and draws ``randint(0, M - 1)``, which never
yields M - 1 (so a masked value is not uniform). Here a mask is AES-256 in counter mode keyed by the
full 32-byte seed: 8 bytes per coordinate, reduced mod 2^bits (exactly uniform, M a power of two).
"""

from __future__ import annotations

import base64
import hashlib
import random

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from flwr.common.secure_aggregation.crypto.shamir import combine_shares, create_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import decrypt, encrypt, generate_shared_key
from flwr.common.secure_aggregation.secaggplus_utils import (
    share_keys_plaintext_concat,
    share_keys_plaintext_separate,
)
from flwr.supercore.primitives.asymmetric import (
    bytes_to_private_key,
    bytes_to_public_key,
    generate_key_pairs,
    private_key_to_bytes,
    public_key_to_bytes,
)

from .field import check_bits, modulus

SEED_BYTES = 32

__all__ = [
    "KeyPair", "new_key_pair", "agreed_seed", "agreed_channel_key", "mask", "neighbour_graph",
    "share_secret", "combine_secret", "seal_shares", "open_shares", "encrypt", "decrypt",
]


class KeyPair:
    """An ECDH key pair as bytes (PEM), made with Flower's primitives."""

    __slots__ = ("secret", "public")

    def __init__(self, secret: bytes, public: bytes) -> None:
        self.secret, self.public = secret, public


def new_key_pair() -> KeyPair:
    sk, pk = generate_key_pairs()
    return KeyPair(private_key_to_bytes(sk), public_key_to_bytes(pk))


def agreed_channel_key(secret: bytes, peer_public: bytes) -> bytes:
    """The Fernet key (urlsafe base64 of 32 bytes) two clients agree on, for encrypting shares."""
    return generate_shared_key(bytes_to_private_key(secret), bytes_to_public_key(peer_public))


def agreed_seed(secret: bytes, peer_public: bytes) -> bytes:
    """The 32-byte pairwise mask seed two clients agree on (the same from either side)."""
    return base64.urlsafe_b64decode(agreed_channel_key(secret, peer_public))


def mask(seed: bytes, size: int, bits: int, label: bytes = b"") -> np.ndarray:
    """``size`` residues mod 2^bits, uniform and independent, expanded from a 32-byte ``seed`` by
    AES-256-CTR (nonce: SHA-256 of ``label``, so one seed gives independent masks per label)."""
    if not isinstance(seed, (bytes, bytearray)) or len(seed) != SEED_BYTES:
        raise ValueError(f"a mask seed is {SEED_BYTES} bytes")
    if size < 0:
        raise ValueError(f"mask size must be >= 0, got {size}")
    check_bits(bits)
    nonce = hashlib.sha256(b"fedpower-secure-sum-mask|" + bytes(label)).digest()[:16]
    stream = Cipher(algorithms.AES(bytes(seed)), modes.CTR(nonce)).encryptor().update(b"\0" * (8 * size))
    words = np.frombuffer(stream, dtype="<u8")
    return (words & np.uint64(modulus(bits) - 1)).astype(np.int64)


def neighbour_graph(nodes: list[int], degree: int, seed: bytes) -> dict[int, tuple[int, ...]]:
    """SecAgg+'s communication graph: a Harary graph H(degree, n) on a random order of ``nodes``
    (a public ``seed`` chosen by the server): every node is joined to the degree/2 nodes on either
    side of it in that order. ``degree`` must be even; at degree >= n - 1 it is the complete graph
    (the original SecAgg)."""
    nodes = [int(x) for x in nodes]
    if len(set(nodes)) != len(nodes):
        raise ValueError("a node is listed more than once")
    n = len(nodes)
    if n < 2:
        raise ValueError(f"a secure sum needs at least 2 clients, got {n}")
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 2:
        raise ValueError(f"the graph degree must be an integer >= 2, got {degree!r}")
    if degree >= n - 1:
        return {u: tuple(sorted(v for v in nodes if v != u)) for u in nodes}
    if degree % 2:
        raise ValueError(f"a sparse graph's degree must be even, got {degree}")
    order = sorted(nodes)
    random.Random(hashlib.sha256(b"fedpower-secure-sum-graph|" + bytes(seed)).digest()).shuffle(order)
    half = degree // 2
    graph = {}
    for p, u in enumerate(order):
        graph[u] = tuple(sorted({order[(p + d) % n] for d in range(-half, half + 1) if d}))
    return graph


def share_secret(secret: bytes, threshold: int, holders: int) -> list[bytes]:
    """Shamir shares of ``secret`` (Flower's primitive): any ``threshold`` of the ``holders`` shares
    give it back, fewer give nothing."""
    if not 1 <= threshold <= holders:
        raise ValueError(f"Shamir threshold must be in [1, {holders}], got {threshold}")
    return create_shares(secret, threshold, holders)


def combine_secret(shares: list[bytes]) -> bytes:
    return combine_shares(list(shares))


def seal_shares(channel_key: bytes, src: int, dst: int, seed_share: bytes, key_share: bytes) -> bytes:
    """One holder's shares of a client's self-mask seed and mask secret key, encrypted for it."""
    return encrypt(channel_key, share_keys_plaintext_concat(src, dst, seed_share, key_share))


def open_shares(channel_key: bytes, ciphertext: bytes, src: int, dst: int) -> tuple[bytes, bytes]:
    """Decrypt and check a sealed pair of shares (raises ``ValueError`` if it names other nodes)."""
    got_src, got_dst, seed_share, key_share = share_keys_plaintext_separate(decrypt(channel_key, ciphertext))
    if (got_src, got_dst) != (src, dst):
        raise ValueError(f"shares sealed from {got_src} to {got_dst} arrived as from {src} to {dst}")
    return seed_share, key_share
