package ai.sluice.example;

import io.grpc.ChannelCredentials;
import io.grpc.Grpc;
import io.grpc.InsecureChannelCredentials;
import io.grpc.ManagedChannelBuilder;
import io.grpc.TlsChannelCredentials;
import java.io.ByteArrayInputStream;
import java.io.FileInputStream;
import java.io.FileNotFoundException;
import java.io.IOException;
import java.io.InputStream;
import java.io.UncheckedIOException;
import java.security.cert.CertificateException;
import java.security.cert.CertificateFactory;
import java.util.List;
import java.util.Map;

/**
 * The TLS flags of Sluice's command-line clients (clients/python/sluice/tls_flags.py), with the same
 * meaning; plaintext unless one is given:
 *
 * <pre>
 *   --tls                                  TLS, trusting the system's root certificates
 *   --tls-ca-cert CA.pem                   TLS, trusting this CA (a server's --tls-cert signed by it)
 *   --tls-client-cert C --tls-client-key K the client's certificate, for a server with --tls-client-ca
 *   --tls-server-name NAME                 the name to verify the server's certificate against
 * </pre>
 *
 * <p>Built on grpc-java's {@link TlsChannelCredentials} (1.34+) and {@link Grpc#newChannelBuilder}, as
 * with any grpc-java transport. grpc-netty does the TLS with netty-tcnative (OpenSSL) where that is on the
 * classpath, else with the JDK; Debian's netty (4.1.48) dropped the JDK's ALPN, which gRPC needs, so
 * run_example.sh puts Debian's netty-tcnative there. Netty reads only PKCS#8 keys ({@code BEGIN PRIVATE
 * KEY}; {@code openssl pkcs8 -topk8 -nocrypt} converts others).
 */
record TlsFlags(boolean tls, String caCert, String clientCert, String clientKey, String serverName) {
  /** The flags that take a value, each defaulting to "" (not given). */
  static final List<String> VALUE_FLAGS =
      List.of("--tls-ca-cert", "--tls-client-cert", "--tls-client-key", "--tls-server-name");

  /** The flag that takes none. */
  static final String TLS = "--tls";

  static TlsFlags of(boolean tls, Map<String, String> flags) {
    return new TlsFlags(tls, flags.get("--tls-ca-cert"), flags.get("--tls-client-cert"),
        flags.get("--tls-client-key"), flags.get("--tls-server-name"));
  }

  /**
   * A channel builder for {@code target} with these flags' security. IllegalArgumentException naming
   * the flag: a client certificate without its key, a file that cannot be read.
   */
  ManagedChannelBuilder<?> channelBuilder(String target) {
    if (clientCert.isEmpty() != clientKey.isEmpty()) {
      throw new IllegalArgumentException(
          "tls-client-cert: --tls-client-cert and --tls-client-key go together");
    }
    if (!tls && caCert.isEmpty() && clientCert.isEmpty() && serverName.isEmpty()) {
      return Grpc.newChannelBuilder(target, InsecureChannelCredentials.create());
    }
    ChannelCredentials credentials = credentials();
    ManagedChannelBuilder<?> builder;
    try {
      builder = Grpc.newChannelBuilder(target, credentials);
    } catch (IllegalArgumentException e) {
      if (clientKey.isEmpty()) {
        throw e;
      }
      // The certificates parsed in credentials(): what netty refused is the key (a PKCS#8 one only).
      throw new IllegalArgumentException("tls-client-key: " + clientKey + ": " + e.getMessage());
    }
    // The authority is the name grpc-java verifies the server's certificate against (and sends as SNI).
    return serverName.isEmpty() ? builder : builder.overrideAuthority(serverName);
  }

  /** TLS credentials: no trust manager is the JDK's default roots. */
  private ChannelCredentials credentials() {
    byte[] ca = caCert.isEmpty() ? null : readCertificates("tls-ca-cert", caCert);
    byte[] cert = clientCert.isEmpty() ? null : readCertificates("tls-client-cert", clientCert);
    byte[] key = clientKey.isEmpty() ? null : read("tls-client-key", clientKey);
    TlsChannelCredentials.Builder credentials = TlsChannelCredentials.newBuilder();
    try {
      if (ca != null) {
        credentials.trustManager(new ByteArrayInputStream(ca));
      }
      if (cert != null) {
        credentials.keyManager(new ByteArrayInputStream(cert), new ByteArrayInputStream(key));
      }
    } catch (IOException e) {
      throw new UncheckedIOException(e); // reading a ByteArrayInputStream throws none
    }
    return credentials.build();
  }

  /** A flag's PEM certificates (a chain, or CAs); IllegalArgumentException naming the flag: none there. */
  private static byte[] readCertificates(String flag, String path) {
    byte[] pem = read(flag, path);
    try {
      if (!CertificateFactory.getInstance("X.509").generateCertificates(new ByteArrayInputStream(pem))
          .isEmpty()) {
        return pem;
      }
    } catch (CertificateException e) {
      // Not PEM certificates: said below.
    }
    throw new IllegalArgumentException(flag + ": " + path + " holds no PEM certificate");
  }

  /** The file a flag names; IllegalArgumentException, as Python's, "FLAG: cannot read PATH (reason)". */
  private static byte[] read(String flag, String path) {
    try (InputStream file = new FileInputStream(path)) {
      return file.readAllBytes();
    } catch (FileNotFoundException e) {
      // Its message is "PATH (reason)", the OS's reason: No such file or directory, Permission denied.
      throw new IllegalArgumentException(flag + ": cannot read " + e.getMessage());
    } catch (IOException e) {
      throw new IllegalArgumentException(flag + ": cannot read " + path + " (" + e.getMessage() + ")");
    }
  }
}
