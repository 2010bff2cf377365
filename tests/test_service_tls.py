"""TLS and mutual TLS on the real gRPC server, with a throwaway CA made in the test.

A TLS server serves clients that trust its CA and refuses plaintext and untrusting clients; an mTLS
server (`--tls-client-ca`) also refuses clients that present no certificate or one from another CA.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from service_harness import ServerThread, tiny_engine_config
from toolchains import REPO

from sluice import Client, SluiceError, generate_request
from sluice.service.cli import build_parser, load_commands, main
from sluice.service.serve_command import server_config
from sluice.service.server import ServerConfig, TlsConfig

MAX_TOKENS = 6


@dataclass(frozen=True)
class Issued:
    """A PEM certificate and its PEM private key."""

    cert: bytes
    key: bytes


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _sign(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None,
    extensions: list[tuple[x509.ExtensionType, bool]],
) -> x509.Certificate:
    """Self-signed when `issuer` is None, else signed by the issuer's (certificate, key)."""
    now = datetime.datetime.now(datetime.UTC)
    issuer_name, signing_key = (_name(subject), key) if issuer is None else (issuer[0].subject, issuer[1])
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )
    for extension, critical in extensions:
        builder = builder.add_extension(extension, critical=critical)
    return builder.sign(signing_key, hashes.SHA256())


class CertificateAuthority:
    """A CA that issues leaf certificates: server ones for 127.0.0.1/localhost, client ones."""

    def __init__(self, name: str) -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.cert = _sign(name, self.key, None, [(x509.BasicConstraints(ca=True, path_length=0), True)])
        self.cert_pem = self.cert.public_bytes(serialization.Encoding.PEM)

    def issue(self, subject: str, *, server: bool) -> Issued:
        key = ec.generate_private_key(ec.SECP256R1())
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        extensions: list[tuple[x509.ExtensionType, bool]] = [
            (x509.BasicConstraints(ca=False, path_length=None), True),
            (x509.ExtendedKeyUsage([usage]), False),
        ]
        if server:
            names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            extensions.append((x509.SubjectAlternativeName(names), False))
        cert = _sign(subject, key, (self.cert, self.key), extensions)
        key_pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        return Issued(cert.public_bytes(serialization.Encoding.PEM), key_pem)


@dataclass(frozen=True)
class Pki:
    ca: CertificateAuthority
    other_ca: CertificateAuthority  # trusted by nobody here
    client: Issued
    stranger: Issued  # a client certificate from other_ca
    tls: TlsConfig
    mtls: TlsConfig


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    directory = tmp_path_factory.mktemp("pki")
    ca, other_ca = CertificateAuthority("sluice-test-ca"), CertificateAuthority("other-ca")
    server = ca.issue("sluice-server", server=True)
    files = {"server.pem": server.cert, "server.key": server.key, "ca.pem": ca.cert_pem}
    for name, data in files.items():
        (directory / name).write_bytes(data)
    cert, key, client_ca = (str(directory / name) for name in ("server.pem", "server.key", "ca.pem"))
    return Pki(
        ca=ca,
        other_ca=other_ca,
        client=ca.issue("sluice-client", server=False),
        stranger=other_ca.issue("stranger", server=False),
        tls=TlsConfig(cert, key),
        mtls=TlsConfig(cert, key, client_ca),
    )


def _serve(llama_dir: str, tls: TlsConfig) -> Iterator[ServerThread]:
    thread = ServerThread(tiny_engine_config(llama_dir), ServerConfig(host="127.0.0.1", port=0, tls=tls))
    thread.start()
    yield thread
    thread.stop()


@pytest.fixture(scope="module")
def tls_server(llama_dir: str, pki: Pki) -> Iterator[ServerThread]:
    yield from _serve(llama_dir, pki.tls)


@pytest.fixture(scope="module")
def mtls_server(llama_dir: str, pki: Pki) -> Iterator[ServerThread]:
    yield from _serve(llama_dir, pki.mtls)


def _greedy(client: Client) -> None:
    """One greedy generation of exactly MAX_TOKENS tokens must complete over the channel."""
    request = generate_request("Hello over TLS", temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    completion = client.complete(request, timeout=30)
    assert len(completion.token_ids) == MAX_TOKENS
    assert completion.text != ""
    assert completion.finish_reason_name == "length"
    assert completion.usage.completion_tokens == MAX_TOKENS


def _refused(client: Client) -> None:
    """The connection never comes up, so the call fails fast with UNAVAILABLE."""
    with client, pytest.raises(SluiceError) as error:
        client.model_info(timeout=10)
    assert error.value.code == grpc.StatusCode.UNAVAILABLE


def _tls_client(target: str, root: bytes, identity: Issued | None = None) -> Client:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=root,
        private_key=identity.key if identity else None,
        certificate_chain=identity.cert if identity else None,
    )
    return Client(target, credentials=credentials)


def test_tls_client_trusting_the_ca_generates(tls_server: ServerThread, pki: Pki) -> None:
    with _tls_client(tls_server.target, pki.ca.cert_pem) as client:
        _greedy(client)


def test_tls_server_answers_on_its_localhost_name(tls_server: ServerThread, pki: Pki) -> None:
    with _tls_client(f"localhost:{tls_server.server.port}", pki.ca.cert_pem) as client:
        info = client.model_info(timeout=10)
    assert (info.block_size, info.num_kv_blocks) == (16, 128)  # tiny_engine_config's cache


def test_plaintext_client_is_refused_by_tls_server(tls_server: ServerThread) -> None:
    _refused(Client(tls_server.target))


def test_client_not_trusting_the_ca_is_refused(tls_server: ServerThread, pki: Pki) -> None:
    _refused(_tls_client(tls_server.target, pki.other_ca.cert_pem))


def test_mtls_client_with_ca_signed_cert_generates(mtls_server: ServerThread, pki: Pki) -> None:
    with _tls_client(mtls_server.target, pki.ca.cert_pem, pki.client) as client:
        _greedy(client)


def test_mtls_client_without_cert_is_refused(mtls_server: ServerThread, pki: Pki) -> None:
    _refused(_tls_client(mtls_server.target, pki.ca.cert_pem))


def test_mtls_client_with_cert_from_another_ca_is_refused(mtls_server: ServerThread, pki: Pki) -> None:
    _refused(_tls_client(mtls_server.target, pki.ca.cert_pem, pki.stranger))


def _parse(*argv: str):
    return build_parser(load_commands()).parse_args(["serve", *argv])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--tls-cert", "s.pem"), "tls-cert: --tls-cert and --tls-key go together"),
        (("--tls-key", "s.key"), "tls-cert: --tls-cert and --tls-key go together"),
        (("--tls-client-ca", "ca.pem"), "tls-client-ca: needs --tls-cert and --tls-key"),
    ],
)
def test_serve_rejects_incomplete_tls_flags(argv, message: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(ValueError) as error:
        server_config(_parse(*argv))
    assert str(error.value) == message
    assert main(["serve", *argv]) == 2
    assert capsys.readouterr().err == f"sluice serve: {message}\n"


def test_a_key_that_is_not_the_certificates_is_refused_naming_the_flag(pki: Pki, tmp_path) -> None:
    """A key of another certificate, and the two files swapped: grpc failed to bind, and the server
    said the port was in use."""
    other_key = tmp_path / "other.key"
    other_key.write_bytes(pki.client.key)
    not_a_ca = tmp_path / "not_ca.pem"
    not_a_ca.write_bytes(pki.client.key)
    cert, key = pki.tls.cert, pki.tls.key
    for bad_cert, bad_key in ((cert, str(other_key)), (key, cert)):
        with pytest.raises(ValueError) as info:
            TlsConfig(bad_cert, bad_key)
        assert str(info.value).startswith(f"tls-key: {bad_key} is not the private key of the certificate")
    with pytest.raises(ValueError, match=rf"^tls-client-ca: {not_a_ca} holds no CA certificate"):
        TlsConfig(cert, key, str(not_a_ca))


def test_a_passphrase_protected_key_is_refused_naming_the_flag(pki: Pki, tmp_path) -> None:
    """OpenSSL asked for the passphrase on the terminal (a server with one waited there forever; without
    one, an OSError traceback)."""
    with open(pki.tls.key, "rb") as f:
        key = serialization.load_pem_private_key(f.read(), password=None)
    encrypted = tmp_path / "encrypted.key"
    encrypted.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"pw"),
        )
    )
    with pytest.raises(ValueError) as info:
        TlsConfig(pki.tls.cert, str(encrypted))
    assert str(info.value) == f"tls-key: {encrypted} is passphrase-protected; grpc needs an unencrypted key"


def test_serve_tls_flags_build_the_tls_config(pki: Pki) -> None:
    cert, key, client_ca = pki.mtls.cert, pki.mtls.key, pki.mtls.client_ca
    args = _parse("--tls-cert", cert, "--tls-key", key, "--tls-client-ca", client_ca)
    assert server_config(args).tls == pki.mtls
    assert server_config(_parse("--tls-cert", cert, "--tls-key", key)).tls == pki.tls
    assert server_config(_parse()).tls is None


HEALTH_PROBE = os.path.join(REPO, "deploy", "grpc_health_probe.py")


def _probe(target: str, *flags: str) -> tuple[int, str]:
    """The image's health probe, run as its HEALTHCHECK runs it: (exit code, the status it printed)."""
    done = subprocess.run(
        [sys.executable, HEALTH_PROBE, "--addr", target, *flags], capture_output=True, text=True, timeout=60
    )
    return done.returncode, done.stdout.rsplit(": ", 1)[-1].strip() or done.stderr


def test_health_probe_speaks_tls(tls_server: ServerThread, pki: Pki) -> None:
    ca = pki.mtls.client_ca
    assert _probe(tls_server.target) == (1, "UNAVAILABLE")  # plaintext, as the kubelet's gRPC probe
    assert _probe(tls_server.target, "--tls-ca-cert", ca) == (0, "SERVING")
    assert _probe(tls_server.target, "--tls") == (1, "UNAVAILABLE")  # no system root signs the test CA
    assert _probe(tls_server.target, "--tls-ca-cert", ca, "--tls-server-name", "localhost") == (0, "SERVING")
    assert _probe(tls_server.target, "--tls-ca-cert", ca, "--tls-server-name", "elsewhere") == (
        1,
        "UNAVAILABLE",
    )


def _client_identity_flags(pki: Pki, directory) -> tuple[str, ...]:
    """The client certificate and key written to `directory`, as the clients' flags name them."""
    (directory / "client.pem").write_bytes(pki.client.cert)
    (directory / "client.key").write_bytes(pki.client.key)
    return (
        "--tls-client-cert",
        str(directory / "client.pem"),
        "--tls-client-key",
        str(directory / "client.key"),
    )


def test_health_probe_presents_a_client_certificate(mtls_server: ServerThread, pki: Pki, tmp_path) -> None:
    ca = pki.mtls.client_ca
    identity = _client_identity_flags(pki, tmp_path)
    assert _probe(mtls_server.target, "--tls-ca-cert", ca, *identity) == (0, "SERVING")
    assert _probe(mtls_server.target, "--tls-ca-cert", ca) == (1, "UNAVAILABLE")
    code, error = _probe(mtls_server.target, "--tls-ca-cert", ca, *identity[:2])
    assert code == 2 and "--tls-client-cert and --tls-client-key go together" in error
    code, error = _probe(mtls_server.target, "--tls-ca-cert", str(tmp_path / "missing.pem"))
    assert code == 2 and "cannot read" in error and "missing.pem" in error


def _sluice(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    """A `sluice` command run in this process: (exit code, stdout, stderr)."""
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_sluice_generate_speaks_tls_and_mtls(
    tls_server: ServerThread, mtls_server: ServerThread, pki: Pki, tmp_path, capsys
) -> None:
    """`sluice generate` had no TLS flags: against a --tls-cert server it failed UNAVAILABLE."""
    ca = pki.mtls.client_ca
    identity = _client_identity_flags(pki, tmp_path)
    generate = ("generate", "--raw", "--max-tokens", str(MAX_TOKENS), "--timeout", "60")
    for target, flags in ((tls_server.target, ()), (mtls_server.target, identity)):
        code, out, err = _sluice(capsys, *generate, "--target", target, "--tls-ca-cert", ca, *flags, "Hello")
        assert code == 0 and out.strip() != "" and err.startswith(f"{MAX_TOKENS} tokens in "), err
    code, _, err = _sluice(capsys, *generate, "--target", tls_server.target, "--timeout", "5", "Hello")
    assert code == 1 and "UNAVAILABLE" in err  # plaintext against TLS
    code, _, err = _sluice(
        capsys, *generate, "--target", mtls_server.target, "--tls-ca-cert", ca, *identity[:2], "Hi"
    )
    assert (code, err) == (
        2,
        "sluice generate: tls-client-cert: --tls-client-cert and --tls-client-key go together\n",
    )
    missing = str(tmp_path / "missing.pem")
    code, _, err = _sluice(capsys, *generate, "--target", tls_server.target, "--tls-ca-cert", missing, "Hi")
    assert (code, err) == (
        2,
        f"sluice generate: tls-ca-cert: cannot read {missing} (No such file or directory)\n",
    )


def test_sluice_bench_speaks_tls(tls_server: ServerThread, pki: Pki, capsys) -> None:
    bench = ("bench", "--target", tls_server.target, "--num-requests", "2", "--warmup", "0", "--no-progress")
    bench += ("--input-len", "8", "--output-len", str(MAX_TOKENS), "--vocab-size", "200")
    code, out, err = _sluice(capsys, *bench, "--tls-ca-cert", pki.mtls.client_ca)
    assert code == 0, err
    row = out.splitlines()[1].split()  # the run's row: its label, then done/requests
    assert row[1] == "2/2" and out.rstrip().endswith("none"), out  # both done, no errors
