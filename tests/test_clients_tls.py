"""The Go and Java examples over TLS and mutual TLS, with the TLS flags of Sluice's Python clients
(clients/python/sluice/tls_flags.py): `--tls-ca-cert` (with `--tls-server-name` where the certificate names
another host than the address's) against a `--tls-cert` server, plus `--tls-client-cert` / `--tls-client-key`
against a `--tls-client-ca` one, stream, abort and multiplex as over plaintext. Without TLS flags, or trusting
a CA that did not sign the server's certificate, they fail; a client certificate without its key, or a file
that cannot be read, exits 1 naming the flag. They spoke only plaintext: against any TLS server they could
only fail."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import test_clients_go_java
from checkpoints import LONG_CONTEXT
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID
from service_harness import ServerThread, long_engine_config
from test_clients_go_java import check_results, run_example
from test_service_tls import CertificateAuthority, _sign

from sluice.service.server import ServerConfig, TlsConfig

# The name the TLS server's certificate gives it, and the only one: not 127.0.0.1, the address dialled.
SERVER_NAME = "sluice.internal"

# The greedy tokens of transformers, which the examples stream over plaintext (a module fixture).
reference = test_clients_go_java.reference


@pytest.fixture(scope="module")
def pems(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """PEM files by role, from test_service_tls's CertificateAuthority: the CA; another CA; a client
    certificate and key from the CA; the mTLS server's certificate and key from the CA, naming 127.0.0.1 and
    localhost; the TLS server's, naming SERVER_NAME only."""
    ca, other_ca = CertificateAuthority("sluice-test-ca"), CertificateAuthority("other-ca")
    client, mtls_server = ca.issue("sluice-client", server=False), ca.issue("sluice-server", server=True)
    key = ec.generate_private_key(ec.SECP256R1())
    extensions: list[tuple[x509.ExtensionType, bool]] = [
        (x509.BasicConstraints(ca=False, path_length=None), True),
        (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False),
        (x509.SubjectAlternativeName([x509.DNSName(SERVER_NAME)]), False),
    ]
    tls_server_cert = _sign(SERVER_NAME, key, (ca.cert, ca.key), extensions)
    contents = {
        "ca": ca.cert_pem,
        "other_ca": other_ca.cert_pem,
        "client_cert": client.cert,
        "client_key": client.key,
        "mtls_server_cert": mtls_server.cert,
        "mtls_server_key": mtls_server.key,
        "tls_server_cert": tls_server_cert.public_bytes(serialization.Encoding.PEM),
        "tls_server_key": key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
    }
    directory = tmp_path_factory.mktemp("client_pki")
    for role, data in contents.items():
        (directory / f"{role}.pem").write_bytes(data)
    return {role: str(directory / f"{role}.pem") for role in contents}


def _serve(llama_long_dir: str, tls: TlsConfig) -> Iterator[ServerThread]:
    config = ServerConfig(host="127.0.0.1", port=0, tls=tls)
    thread = ServerThread(long_engine_config(llama_long_dir), config).start()
    yield thread
    thread.stop()


@pytest.fixture(scope="module")
def tls_server(llama_long_dir: str, pems: dict[str, str]) -> Iterator[ServerThread]:
    """TLS, its certificate naming SERVER_NAME only."""
    yield from _serve(llama_long_dir, TlsConfig(pems["tls_server_cert"], pems["tls_server_key"]))


@pytest.fixture(scope="module")
def mtls_server(llama_long_dir: str, pems: dict[str, str]) -> Iterator[ServerThread]:
    """Mutual TLS, its certificate naming 127.0.0.1 (and localhost): clients must present one from the CA."""
    tls = TlsConfig(pems["mtls_server_cert"], pems["mtls_server_key"], client_ca=pems["ca"])
    yield from _serve(llama_long_dir, tls)


@pytest.mark.parametrize("language", ["go", "java"])
def test_tls_with_the_ca_and_the_certificates_name(
    language: str, tls_server: ServerThread, pems: dict[str, str], reference
) -> None:
    flags = ("--tls-ca-cert", pems["ca"], "--tls-server-name", SERVER_NAME)
    result = run_example(language, tls_server.target, *flags, check=False)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    check_results(language, result.stdout.splitlines(), reference, LONG_CONTEXT)
    assert tls_server.wait_idle().num_kv_blocks_used == 0


@pytest.mark.parametrize("language", ["go", "java"])
def test_mtls_with_the_client_certificate(
    language: str, mtls_server: ServerThread, pems: dict[str, str], reference
) -> None:
    """The certificate names 127.0.0.1, the address dialled: no --tls-server-name."""
    flags = ("--tls-ca-cert", pems["ca"], "--tls-client-cert", pems["client_cert"])
    flags += ("--tls-client-key", pems["client_key"])
    result = run_example(language, mtls_server.target, *flags, check=False)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    check_results(language, result.stdout.splitlines(), reference, LONG_CONTEXT)
    assert mtls_server.wait_idle().num_kv_blocks_used == 0


# What each example says when no connection comes up: grpc-go's dial error names the last connection's
# failure after the deadline (grpc.WithReturnConnectionError; it used to say only "context deadline
# exceeded"), grpc-java's call fails UNAVAILABLE (it used to wait for the connection until DEADLINE_EXCEEDED).
REFUSED = {"go": "context deadline exceeded: ", "java": "io.grpc.StatusRuntimeException: UNAVAILABLE"}


@pytest.mark.parametrize("language", ["go", "java"])
def test_plaintext_against_tls_fails(language: str, tls_server: ServerThread) -> None:
    result = run_example(language, tls_server.target, check=False)
    assert result.returncode == 1, result.stdout
    assert REFUSED[language] in result.stderr, result.stderr
    assert "done" not in result.stdout.splitlines()


@pytest.mark.parametrize("language", ["go", "java"])
def test_a_ca_that_did_not_sign_the_servers_certificate_fails_the_handshake(
    language: str, tls_server: ServerThread, pems: dict[str, str]
) -> None:
    flags = ("--tls-ca-cert", pems["other_ca"], "--tls-server-name", SERVER_NAME)
    result = run_example(language, tls_server.target, *flags, check=False)
    assert result.returncode == 1, result.stdout
    assert REFUSED[language] in result.stderr, result.stderr
    handshake = {
        "go": ["authentication handshake failed: x509: certificate signed by unknown authority"],
        "java": ["SSLHandshakeException", "unable to find valid certification path to requested target"],
    }
    assert [m for m in handshake[language] if m not in result.stderr] == [], result.stderr


@pytest.mark.parametrize("language", ["go", "java"])
def test_bad_tls_flags_exit_1_naming_the_flag(language: str, pems: dict[str, str], tmp_path: Path) -> None:
    """Before any connection: the address serves nothing."""
    result = run_example(language, "127.0.0.1:1", "--tls-client-cert", pems["client_cert"], check=False)
    assert result.returncode == 1, result.stdout
    assert "tls-client-cert: --tls-client-cert and --tls-client-key go together" in result.stderr
    missing = str(tmp_path / "missing.pem")
    result = run_example(language, "127.0.0.1:1", "--tls-ca-cert", missing, check=False)
    assert result.returncode == 1, result.stdout
    # Go's reason is the OS's lower-cased, Java's as Python prints it.
    assert f"tls-ca-cert: cannot read {missing} (no such file or directory)".lower() in result.stderr.lower()
