"""Keys and certificates for a federation: a private CA, TLS certificates, Ed25519 signing keys.

Used by ``edgepfl provision``. TLS keys are ECDSA P-256 (every TLS stack, Mosquitto's
OpenSSL included, accepts them, and they are small and fast on a Raspberry Pi);
message-signing keys are Ed25519 (:class:`~edgepfl.specs.SecuritySpec`).

Files: private keys are PEM PKCS#8, unencrypted, mode 0600 from the moment they exist
(written through :mod:`edgepfl.atomic`, whose temp files are 0600); certificates and
public keys are PEM, mode 0644.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TypeAlias

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from .atomic import write_bytes

PRIVATE_MODE = 0o600
PUBLIC_MODE = 0o644

TlsKey: TypeAlias = ec.EllipticCurvePrivateKey
#: A certificate authority: its key and its self-signed certificate.
CA: TypeAlias = tuple[TlsKey, x509.Certificate]


def _name(common_name: str, organization: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _now() -> dt.datetime:
    # a minute back, so a device whose clock lags slightly still accepts a fresh certificate
    return dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=1)


def new_tls_key() -> TlsKey:
    """A fresh ECDSA P-256 key for a CA or a TLS certificate."""
    return ec.generate_private_key(ec.SECP256R1())


def new_ca(organization: str, days: int = 3650) -> CA:
    """A self-signed CA that may sign leaf certificates only (path length 0)."""
    key = new_tls_key()
    name = _name(f"{organization} CA", organization)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now())
        .not_valid_after(_now() + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _subject_alt_names(names: Sequence[str]) -> list[x509.GeneralName]:
    out: list[x509.GeneralName] = []
    for name in dict.fromkeys(names):  # de-duplicated, order kept
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            out.append(x509.DNSName(name))
    return out


def issue(ca_key: TlsKey, ca_cert: x509.Certificate, common_name: str, *, server_names: Sequence[str] = (),
          days: int = 825) -> tuple[TlsKey, x509.Certificate]:
    """A leaf certificate signed by the CA: a server certificate when ``server_names`` are given, else a client's.

    ``server_names`` (host names or IP addresses) become the subjectAltName that
    clients verify the broker's host against; a client certificate's common name is
    its identity (Mosquitto's ``use_identity_as_username``).
    """
    key = new_tls_key()
    organization = ca_cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server_names else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name, str(organization)))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now())
        .not_valid_after(_now() + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=True, key_cert_sign=False, crl_sign=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
    )
    if server_names:
        builder = builder.add_extension(x509.SubjectAlternativeName(_subject_alt_names(server_names)), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


# --------------------------------------------------------------------------- files


def write_private_key(path: Path, key: TlsKey) -> None:
    """PEM PKCS#8, unencrypted, mode 0600 (never readable by others, not even for a moment)."""
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    write_bytes(path, pem, private=True)


def write_certificate(path: Path, cert: x509.Certificate) -> None:
    """PEM certificate, mode 0644."""
    write_public(path, cert.public_bytes(serialization.Encoding.PEM))


def write_public(path: Path, data: bytes) -> None:
    """Any file others may read (certificates, public keys, configs), mode 0644."""
    write_bytes(path, data)
    os.chmod(path, PUBLIC_MODE)


def write_secret(path: Path, data: bytes) -> None:
    """Any secret file (passwords, the broker's password file), mode 0600."""
    write_bytes(path, data, private=True)


def load_ca(key_path: Path, cert_path: Path) -> CA:
    """The CA written by an earlier ``edgepfl provision`` (to add agents without a new CA)."""
    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{key_path}: not the ECDSA CA key edgepfl provision writes")
    return key, x509.load_pem_x509_certificate(cert_path.read_bytes())
