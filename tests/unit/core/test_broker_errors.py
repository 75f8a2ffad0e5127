"""A first connection that fails says why: where a password comes from, and each socket
error's cause and retry policy (the real failures, one per cause:
tests/integration/broker/test_broker_failures_live.py).
"""

from __future__ import annotations

import socket
import ssl

import pytest

from edgepfl.config import BrokerConfig
from edgepfl.protocol.connection import (
    BrokerLogin,
    BrokerUnreachable,
    FailureCause,
    classify_connack,
    classify_socket_error,
)

# --------------------------------------------------------------------------- unit


def test_password_comes_from_exactly_one_source(tmp_path, monkeypatch):
    secret = tmp_path / "pw"
    secret.write_text("from-file\n")
    secret.chmod(0o600)
    assert BrokerConfig(password_file=str(secret)).read_password() == "from-file"
    monkeypatch.setenv("EDGEPFL_TEST_PW", "from-env")
    assert BrokerConfig(password_env="EDGEPFL_TEST_PW").read_password() == "from-env"
    assert BrokerConfig(password="plain").read_password() == "plain"
    assert BrokerConfig().read_password() is None
    with pytest.raises(ValueError, match="one way, not password and password_env"):
        BrokerConfig(password="a", password_env="EDGEPFL_TEST_PW")
    with pytest.raises(ValueError, match="cert_file and key_file go together"):
        BrokerConfig(cert_file="c.crt")
    monkeypatch.delenv("EDGEPFL_TEST_PW")
    with pytest.raises(BrokerUnreachable, match="EDGEPFL_TEST_PW is not set") as err:
        BrokerLogin.from_config(BrokerConfig(password_env="EDGEPFL_TEST_PW"))
    assert err.value.cause is FailureCause.CREDENTIALS
    with pytest.raises(BrokerUnreachable, match="password_file .*missing"):
        BrokerLogin.from_config(BrokerConfig(password_file=str(tmp_path / "missing")))
    with pytest.raises(BrokerUnreachable, match="ca_file .* no such file"):
        BrokerLogin(ca_file=str(tmp_path / "ca.crt")).tls_context()


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620])
def test_a_secret_file_others_may_read_or_write_is_refused_in_one_line(tmp_path, mode):
    """A password or a TLS client key that another local user can read is a device identity
    anyone on the box can take: refused as the signing key is, naming the file and the fix."""
    secret = tmp_path / "secret"
    secret.write_text("from-file\n")
    secret.chmod(mode)
    with pytest.raises(BrokerUnreachable, match=f"password_file .* accessible by others \\(mode {mode:o}\\); "
                                                 "chmod 600 it") as err:
        BrokerLogin.from_config(BrokerConfig(password_file=str(secret)))
    assert err.value.cause is FailureCause.CREDENTIALS and "\n" not in str(err.value)
    with pytest.raises(BrokerUnreachable, match="key_file .* accessible by others") as err:
        BrokerLogin(cert_file=str(secret), key_file=str(secret)).tls_context()
    assert err.value.cause is FailureCause.CREDENTIALS
    secret.chmod(0o600)
    assert BrokerConfig(password_file=str(secret)).read_password() == "from-file"


def test_each_socket_error_has_its_own_cause_and_retry_policy():
    cases = [
        (ssl.SSLCertVerificationError(1, "certificate verify failed"), FailureCause.TLS, False),
        (ssl.SSLError(1, "alert bad certificate"), FailureCause.TLS_CLIENT, False),
        (socket.gaierror(-2, "Name or service not known"), FailureCause.DNS, True),
        (ConnectionRefusedError(111, "Connection refused"), FailureCause.REFUSED, True),
        (TimeoutError("timed out"), FailureCause.UNREACHABLE, True),
        (OSError(113, "No route to host"), FailureCause.UNREACHABLE, True),
    ]
    for exc, cause, transient in cases:
        failure = classify_socket_error(exc, "mqtt.example.org", 8883)
        assert (failure.cause, failure.transient) == (cause, transient), exc
        assert "mqtt.example.org" in failure.message and "\n" not in failure.message
    refused = classify_connack("Not authorized", 135, "h", 1, "pi-07")
    assert refused.cause is FailureCause.AUTH and not refused.transient and "'pi-07'" in refused.message
    assert classify_connack("Server unavailable", 136, "h", 1, None).transient
    assert issubclass(BrokerUnreachable, ConnectionError)  # the CLI prints ConnectionError as one line


def test_a_broker_that_closes_the_handshake_is_full_not_a_bad_certificate(tmp_path):
    """A broker at max_connections (23 idle sockets filled the red team's) accepts the TCP
    connection and closes it without a TLS alert. The agent used to exit 4 blaming its
    client certificate; it is a transient failure that says the broker may be full."""
    import threading

    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def accept_and_close():
        conn, _ = server.accept()
        conn.close()  # no TLS alert: the broker is full

    thread = threading.Thread(target=accept_and_close, daemon=True)
    thread.start()
    context = ssl.create_default_context()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
            context.wrap_socket(raw, server_hostname="localhost")
    except (ssl.SSLError, OSError) as exc:  # the real exception this host's TLS stack raises
        failure = classify_socket_error(exc, "127.0.0.1", port)
    else:
        pytest.fail("the handshake with a closed socket succeeded")
    finally:
        thread.join(10)
        server.close()
    assert failure.cause is FailureCause.CLOSED and failure.transient
    assert "full" in failure.message and "certificate" not in failure.message
