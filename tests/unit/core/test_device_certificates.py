"""Device signing certificates (edgepfl/pki.py, protocol 1.14): the federation's CA vouches that
an Ed25519 key is one agent's, and a neighbour that trusts the CA checks it before it seals
anything to keys relayed by the coordinator. Each way a certificate can be wrong is refused
with its reason."""

from __future__ import annotations

import datetime as dt

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding

from edgepfl import pki
from edgepfl.protocol.signing import SIGNATURE_CONTEXT, Signer


def der(cert) -> bytes:
    return cert.public_bytes(Encoding.DER)


def test_a_certificate_the_ca_issued_gives_back_the_agents_key_and_every_wrong_one_says_why():
    ca = pki.new_ca("edgepfl fed")
    key = Ed25519PrivateKey.generate().public_key()
    cert = pki.issue_signing_certificate(*ca, "pi-01", key)
    assert pki.certified_signing_key(ca[1], der(cert), "pi-01").public_bytes_raw() == key.public_bytes_raw()

    other_ca = pki.new_ca("edgepfl fed")
    tls_key, tls_cert = pki.issue(*ca, "pi-01")
    cases = {
        "not issued by the federation's CA": (ca[1], der(pki.issue_signing_certificate(*other_ca, "pi-01", key)),
                                              "pi-01", None),
        "not pi-02": (ca[1], der(cert), "pi-02", None),
        "not valid now": (ca[1], der(cert), "pi-01", dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=4000)),
        "not an Ed25519 signing key": (ca[1], der(tls_cert), "pi-01", None),
        "a CA certificate": (ca[1], der(ca[1]), "edgepfl fed CA", None),
        "not a DER certificate": (ca[1], b"\x30\x03garbage", "pi-01", None),
    }
    for says, (trusted, data, agent, now) in cases.items():
        with pytest.raises(ValueError, match=says):
            pki.certified_signing_key(trusted, data, agent, now=now)


def test_a_statement_signature_is_never_a_frame_signature():
    signer = Signer.from_private(Ed25519PrivateKey.generate())
    statement = b"edgepfl secagg v2 keys\0..."
    signer.public.verify(signer.sign_statement(statement), statement)
    with pytest.raises(ValueError, match="frame"):
        signer.sign_statement(SIGNATURE_CONTEXT + b"a header")
