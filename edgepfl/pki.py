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
from typing import TYPE_CHECKING, TypeAlias

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from .atomic import write_bytes

if TYPE_CHECKING:
    from .protocol.secagg import PeerKeys

PRIVATE_MODE = 0o600
PUBLIC_MODE = 0o644

TlsKey: TypeAlias = ec.EllipticCurvePrivateKey
#: A certificate authority: its key and its self-signed certificate.
CA: TypeAlias = tuple[TlsKey, x509.Certificate]
#: what a leaf certificate certifies: a TLS key, or an agent's Ed25519 message-signing key
CertifiedKey: TypeAlias = ec.EllipticCurvePublicKey | ed25519.Ed25519PublicKey


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


def _leaf(ca_key: TlsKey, ca_cert: x509.Certificate, common_name: str, public_key: CertifiedKey, days: int, *,
          key_agreement: bool) -> x509.CertificateBuilder:
    """A leaf certificate of the CA for ``public_key``, named ``common_name``, not yet signed:
    signatures (and ``key_agreement`` for TLS), never a CA."""
    organization = ca_cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value
    return (
        x509.CertificateBuilder()
        .subject_name(_name(common_name, str(organization)))
        .issuer_name(ca_cert.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now())
        .not_valid_after(_now() + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=key_agreement, key_cert_sign=False,
                                     crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
    )


def issue(ca_key: TlsKey, ca_cert: x509.Certificate, common_name: str, *, server_names: Sequence[str] = (),
          days: int = 825) -> tuple[TlsKey, x509.Certificate]:
    """A leaf certificate signed by the CA: a server certificate when ``server_names`` are given, else a client's.

    ``server_names`` (host names or IP addresses) become the subjectAltName that
    clients verify the broker's host against; a client certificate's common name is
    its identity (Mosquitto's ``use_identity_as_username``).
    """
    key = new_tls_key()
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server_names else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = _leaf(ca_key, ca_cert, common_name, key.public_key(), days, key_agreement=True)
    builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if server_names:
        builder = builder.add_extension(x509.SubjectAlternativeName(_subject_alt_names(server_names)), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def issue_signing_certificate(ca_key: TlsKey, ca_cert: x509.Certificate, agent_id: str,
                              public_key: ed25519.Ed25519PublicKey, days: int = 3650) -> x509.Certificate:
    """The CA's word that ``public_key`` is ``agent_id``'s message-signing key: a leaf certificate
    (common name the agent id, the Ed25519 key itself, for signatures only). A neighbour that
    trusts the CA checks, with it, the keys a device hands out through the coordinator in a
    secure round (PROTOCOL.md §19): the coordinator cannot make one without the CA key."""
    return _leaf(ca_key, ca_cert, agent_id, public_key, days, key_agreement=False).sign(ca_key, hashes.SHA256())


def certified_signing_key(ca_cert: x509.Certificate, der: bytes, agent_id: str,
                          now: dt.datetime | None = None) -> ed25519.Ed25519PublicKey:
    """The Ed25519 key a certificate (DER) certifies as ``agent_id``'s: ValueError, with the
    reason, unless the CA signed it, it is valid now, names ``agent_id`` and holds an Ed25519
    key for signatures (not another CA)."""
    try:
        cert = x509.load_der_x509_certificate(der)
    except ValueError:
        raise ValueError("not a DER certificate") from None
    try:
        cert.verify_directly_issued_by(ca_cert)
    except (ValueError, TypeError, InvalidSignature):
        raise ValueError("not issued by the federation's CA") from None
    now = now or dt.datetime.now(dt.timezone.utc)
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        raise ValueError(f"not valid now (valid {cert.not_valid_before_utc:%Y-%m-%d} to "
                         f"{cert.not_valid_after_utc:%Y-%m-%d})")
    names = [str(a.value) for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    if names != [agent_id]:
        raise ValueError(f"issued to {names}, not {agent_id}")
    try:
        if cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca:
            raise ValueError("a CA certificate, not a device's")
    except x509.ExtensionNotFound:
        raise ValueError("no basic constraints: not a device certificate") from None
    key = cert.public_key()
    if not isinstance(key, ed25519.Ed25519PublicKey):
        raise ValueError(f"certifies a {type(key).__name__}, not an Ed25519 signing key")
    return key



def uncertified_keys(ca_cert: x509.Certificate, keys: PeerKeys, context: bytes) -> str | None:
    """Why an agent's secure-round ``keys`` are not vouched for by a signing key ``ca_cert``
    certified as that agent's, for the round of ``context`` (None: they are; protocol 1.14):
    what every neighbour checks before it seals anything to them (edge_agent/secure.py), and
    the coordinator first, so that one device with uncertified keys costs its round nothing."""
    from .protocol.secagg import unb64
    from .secagg import keys_statement

    if keys.certificate is None or keys.signature is None:
        return "no certificate"
    try:
        key = certified_signing_key(ca_cert, unb64(keys.certificate), keys.agent)
        key.verify(unb64(keys.signature), keys_statement(context, keys.agent, unb64(keys.mask_public),
                                                          unb64(keys.share_public)))
    except ValueError as exc:
        return str(exc)
    except InvalidSignature:
        return "the keys are not the ones its certified key signed for this session"
    return None


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


def load_certificate(path: str | Path) -> x509.Certificate:
    """A PEM certificate file (ValueError when it holds none)."""
    try:
        return x509.load_pem_x509_certificate(Path(path).read_bytes())
    except ValueError as exc:
        raise ValueError(f"{path}: not a PEM certificate ({exc})") from None


def load_ca(key_path: Path, cert_path: Path) -> CA:
    """The CA written by an earlier ``edgepfl provision`` (to add agents without a new CA)."""
    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{key_path}: not the ECDSA CA key edgepfl provision writes")
    return key, x509.load_pem_x509_certificate(cert_path.read_bytes())
