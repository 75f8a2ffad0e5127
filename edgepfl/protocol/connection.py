"""Logging in to the broker, and why a connection failed.

* :class:`BrokerLogin` — everything a client presents to the broker: username, the
  password read from its configured source, and the TLS files (CA, client
  certificate and key). Built once from a :class:`~edgepfl.specs.BrokerConfig`.
* :class:`BrokerUnreachable` — the typed error of a connection that could not be
  made, with its :class:`FailureCause`. It is a ``ConnectionError``, so command-line
  front ends print it as one line.
* :func:`classify_socket_error` and :func:`classify_connack` — turn what the socket,
  TLS or the broker's CONNACK said into a cause, a one-line message that says what to
  do, and whether retrying can help (a refused port can come up; a CA that does not
  match or a wrong password will not fix themselves).
"""

from __future__ import annotations

import socket
import ssl
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from ..atomic import read_private
from ..specs import BrokerConfig


class FailureCause(str, Enum):
    """Why a connection to the broker could not be made."""

    DNS = "dns"  # the host name does not resolve
    REFUSED = "refused"  # nothing listens on the port (or a firewall rejects)
    UNREACHABLE = "unreachable"  # no route, or the TCP connect timed out
    TLS = "tls"  # the broker's certificate does not verify (CA, hostname, expiry)
    TLS_CLIENT = "tls_client"  # the broker rejected this client's certificate, or TLS itself failed
    CLOSED = "closed"  # the broker closed the connection before answering CONNECT
    AUTH = "auth"  # CONNACK: bad user name or password / not authorized
    BROKER = "broker"  # CONNACK: server unavailable, or another refusal
    CREDENTIALS = "credentials"  # this client's own password or TLS files cannot be read
    TIMEOUT = "timeout"  # no CONNACK within the time allowed


@dataclass(frozen=True)
class Failure:
    """One classified connection attempt: its cause, a one-line explanation, and whether to retry."""

    cause: FailureCause
    message: str
    transient: bool


class BrokerUnreachable(ConnectionError):
    """No connection to the broker; ``cause`` says why (a :class:`FailureCause`)."""

    def __init__(self, cause: FailureCause, message: str):
        super().__init__(message)
        self.cause = cause


@dataclass(frozen=True)
class BrokerLogin:
    """What a client presents to the broker. ``password`` is already read from its source."""

    username: str | None = None
    password: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    @classmethod
    def from_config(cls, broker: BrokerConfig) -> BrokerLogin:
        """Read the password from its source; an unreadable one raises :class:`BrokerUnreachable` (``credentials``)."""
        try:
            password = broker.read_password()
        except ValueError as exc:
            raise BrokerUnreachable(FailureCause.CREDENTIALS, f"cannot log in to the broker: {exc}") from None
        return cls(broker.username, password, broker.ca_file, broker.cert_file, broker.key_file)

    def tls_context(self) -> ssl.SSLContext:
        """A client TLS context: certificate and hostname verification on, against ``ca_file`` or the system store."""
        for field in ("ca_file", "cert_file", "key_file"):
            path = getattr(self, field)
            if path is not None and not Path(path).is_file():
                raise BrokerUnreachable(FailureCause.CREDENTIALS, f"broker.{field} {path}: no such file")
        if self.key_file is not None:
            try:  # a client key others can read is a stolen device identity: refused, as the signing key is
                read_private(self.key_file, "broker.key_file")
            except ValueError as exc:
                raise BrokerUnreachable(FailureCause.CREDENTIALS, str(exc)) from None
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ca_file)
        if self.cert_file is not None:
            try:
                context.load_cert_chain(self.cert_file, self.key_file)
            except (ssl.SSLError, OSError) as exc:
                raise BrokerUnreachable(
                    FailureCause.CREDENTIALS,
                    f"broker.cert_file {self.cert_file} / key_file {self.key_file} cannot be loaded: {exc}") from None
        return context


def classify_socket_error(exc: BaseException, host: str, port: int) -> Failure:
    """Classify an exception raised while opening the TCP/TLS connection to ``host:port``."""
    where = f"MQTT broker {host}:{port}"
    if isinstance(exc, ssl.SSLCertVerificationError):
        why = getattr(exc, "verify_message", None) or getattr(exc, "reason", None) or exc
        return Failure(FailureCause.TLS, (
            f"TLS verification of {where} failed ({why}): set broker.ca_file to the CA that signed "
            f"the broker's certificate (edgepfl provision writes ca.crt), and connect by a name the certificate lists"
        ), transient=False)
    if isinstance(exc, (ssl.SSLEOFError, ssl.SSLZeroReturnError, ConnectionResetError, BrokenPipeError)):
        # closed mid-handshake without a TLS alert: what a broker at max_connections does (a
        # rejected certificate comes with an alert, below); the next try may get in
        return closed_before_connack(host, port, f"closed during the TLS handshake: {exc}")
    if isinstance(exc, ssl.SSLError):
        why = getattr(exc, "reason", None) or exc
        return Failure(FailureCause.TLS_CLIENT, (
            f"TLS handshake with {where} failed ({why}): check that the broker listens with TLS on this "
            f"port and accepts this client's certificate (broker.cert_file / key_file, signed by its CA)"
        ), transient=False)
    if isinstance(exc, socket.gaierror):
        return Failure(FailureCause.DNS, (
            f"cannot resolve the broker's host name {host!r} ({exc.strerror or exc}): check broker.url and DNS"
        ), transient=True)
    if isinstance(exc, ConnectionRefusedError):
        return Failure(FailureCause.REFUSED, (
            f"connection to {where} refused: nothing listens there (is the broker running, is the port right?)"
        ), transient=True)
    if isinstance(exc, (TimeoutError, socket.timeout)):
        return Failure(FailureCause.UNREACHABLE, (
            f"{where} did not answer the TCP connect (timed out): check the network and firewalls"
        ), transient=True)
    if isinstance(exc, OSError):
        return Failure(FailureCause.UNREACHABLE, (
            f"cannot reach {where}: {exc.strerror or exc}"
        ), transient=True)
    return Failure(FailureCause.UNREACHABLE, f"cannot connect to {where}: {exc}", transient=True)


#: CONNACK reason codes (paho reports MQTT 3.1.1 return codes 4 and 5 as these MQTT 5 codes).
_BAD_CREDENTIALS = 134
_NOT_AUTHORIZED = 135
_SERVER_UNAVAILABLE = 136


def classify_connack(reason: object, value: int, host: str, port: int, username: str | None) -> Failure:
    """Classify a CONNACK that refused the connection (``value`` is the MQTT 5 reason code)."""
    where = f"MQTT broker {host}:{port}"
    if value in (_BAD_CREDENTIALS, _NOT_AUTHORIZED):
        who = f"user {username!r}" if username else "an anonymous client"
        return Failure(FailureCause.AUTH, (
            f"{where} refused {who} ({reason}): check broker.username and the password / client certificate, "
            f"and that the broker's password file or CA lists this client"
        ), transient=False)
    if value == _SERVER_UNAVAILABLE:
        return Failure(FailureCause.BROKER, f"{where} is unavailable ({reason}); retrying", transient=True)
    return Failure(FailureCause.BROKER, f"{where} refused the connection ({reason})", transient=False)


def closed_before_connack(host: str, port: int, detail: str | None, *, presented_certificate: bool = True) -> Failure:
    """The broker dropped the connection before its CONNACK: a rejected client certificate, or a limit.

    With TLS 1.3 the broker's verdict on the client certificate arrives after the
    handshake, so paho may see only a closed socket; ``presented_certificate=False``
    (TLS without ``cert_file``) adds the likely cause to the message. Still transient:
    a full broker (``max_connections``) closes connections the same way.
    """
    said = f" ({detail})" if detail else ""
    if detail is not None and "certificate" in detail.lower():
        return Failure(FailureCause.TLS_CLIENT, (
            f"MQTT broker {host}:{port} rejected this client's TLS certificate{said}: set broker.cert_file / "
            f"key_file to a certificate signed by the broker's CA (edgepfl provision writes client.crt / client.key)"
        ), transient=False)
    hint = ("this client presents no TLS certificate (broker.cert_file / key_file), which a broker with "
            "require_certificate closes on; otherwise " if not presented_certificate else "")
    return Failure(FailureCause.CLOSED, (
        f"MQTT broker {host}:{port} closed the connection before accepting it{said}: {hint}"
        f"the broker may be full (max_connections) or overloaded; retrying; its log says which"
    ), transient=True)
