"""``fedpower-credentials``: TLS certificates and SuperNode keys for a secure deployment.

Writes, into ``--out`` (created, mode 0700; private keys mode 0600):

  ca.crt, ca.key           a private certificate authority (ECDSA P-384, valid ``--days``)
  server.pem, server.key   the SuperLink's certificate, signed by the CA, with a subjectAltName for
                           every ``--hosts`` entry (DNS names and IP addresses); clients verify it
                           with ca.crt (``--root-certificates``)
  keys/<name>, keys/<name>.pub
                           one ECDSA SECP384R1 key pair per ``--supernodes`` name, OpenSSH format:
                           register the .pub with ``flwr supernode register``, start the SuperNode
                           with ``--auth-supernode-private-key keys/<name>``

Nothing here is ever committed: generate the files on each machine (or in the test) and keep the
private keys where they are used. Existing files are never overwritten (``--force`` to replace).

  fedpower-credentials --out certs --hosts localhost 127.0.0.1 superlink.example.org --supernodes silo0 silo1
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
import sys
from pathlib import Path
from typing import Sequence


def _write_private(path: Path, data: bytes, force: bool) -> None:
    if path.exists() and not force:
        raise FileExistsError(f"{path} exists (use --force to replace it)")
    fd = os.open(str(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.chmod(path, 0o600)


def _write_public(path: Path, data: bytes, force: bool) -> None:
    if path.exists() and not force:
        raise FileExistsError(f"{path} exists (use --force to replace it)")
    path.write_bytes(data)


def _san(hosts: Sequence[str]):
    from cryptography import x509

    names = []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    return x509.SubjectAlternativeName(names)


def make_credentials(out: str | Path, *, hosts: Sequence[str] = ("localhost", "127.0.0.1"),
                     supernodes: Sequence[str] = (), days: int = 365, force: bool = False) -> dict[str, Path]:
    """Generate the CA, the SuperLink certificate and the SuperNode key pairs; return their paths."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if not hosts:
        raise ValueError("give at least one host name or address for the SuperLink certificate")
    bad = [n for n in supernodes if not n or "/" in n or n.startswith(".")]
    if bad:
        raise ValueError(f"bad SuperNode key name(s): {bad}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True, mode=0o700)
    now = dt.datetime.now(dt.timezone.utc)
    pem = serialization.Encoding.PEM
    pkcs8 = serialization.PrivateFormat.PKCS8
    nokey = serialization.NoEncryption()

    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedpower deployment CA")])
    ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                            content_commitment=False, key_encipherment=False, data_encipherment=False,
                                            key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
               .sign(ca_key, hashes.SHA384()))
    server_key = ec.generate_private_key(ec.SECP384R1())
    server_cert = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
                   .issuer_name(ca_name).public_key(server_key.public_key())
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
                   .add_extension(_san(hosts), critical=False)
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
                   .sign(ca_key, hashes.SHA384()))
    paths = {"ca.crt": out / "ca.crt", "ca.key": out / "ca.key", "server.pem": out / "server.pem",
             "server.key": out / "server.key"}
    _write_private(paths["ca.key"], ca_key.private_bytes(pem, pkcs8, nokey), force)
    _write_public(paths["ca.crt"], ca_cert.public_bytes(pem), force)
    _write_private(paths["server.key"], server_key.private_bytes(pem, pkcs8, nokey), force)
    _write_public(paths["server.pem"], server_cert.public_bytes(pem), force)
    if supernodes:
        keys = out / "keys"
        keys.mkdir(exist_ok=True, mode=0o700)
        for name in supernodes:
            key = ec.generate_private_key(ec.SECP384R1())
            priv = key.private_bytes(pem, serialization.PrivateFormat.OpenSSH, nokey)
            pub = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
            _write_private(keys / name, priv, force)
            _write_public(keys / f"{name}.pub", pub + b"\n", force)
            paths[f"keys/{name}"] = keys / name
            paths[f"keys/{name}.pub"] = keys / f"{name}.pub"
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fedpower-credentials", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for the files (created)")
    p.add_argument("--hosts", nargs="+", default=["localhost", "127.0.0.1"],
                   help="names and addresses SuperNodes and the flwr CLI use to reach the SuperLink")
    p.add_argument("--supernodes", nargs="*", default=[], metavar="NAME", help="one key pair per SuperNode")
    p.add_argument("--days", type=int, default=365, help="validity of the certificates (default 365)")
    p.add_argument("--force", action="store_true", help="replace existing files")
    a = p.parse_args(argv)
    try:
        paths = make_credentials(a.out, hosts=a.hosts, supernodes=a.supernodes, days=a.days, force=a.force)
    except (ValueError, FileExistsError, OSError) as exc:
        print(f"fedpower-credentials: {exc}", file=sys.stderr)
        return 2
    for name, path in paths.items():
        print(f"{name:24s} {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
