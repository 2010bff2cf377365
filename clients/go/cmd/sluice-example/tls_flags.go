package main

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"os"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
)

// tlsFlags are the TLS flags of Sluice's command-line clients (clients/python/sluice/tls_flags.py), with
// the same meaning; plaintext unless one is given:
//
//	--tls                                  TLS, trusting the system's root certificates
//	--tls-ca-cert CA.pem                   TLS, trusting this CA (a server's --tls-cert signed by it)
//	--tls-client-cert C --tls-client-key K the client's certificate, for a server with --tls-client-ca
//	--tls-server-name NAME                 the name to verify the server's certificate against
type tlsFlags struct {
	enabled    bool
	caCert     string
	clientCert string
	clientKey  string
	serverName string
}

func addTLSFlags(flags *flag.FlagSet) *tlsFlags {
	f := &tlsFlags{}
	flags.BoolVar(&f.enabled, "tls", false, "TLS, trusting the system's root certificates")
	flags.StringVar(&f.caCert, "tls-ca-cert", "", "TLS, trusting this CA's certificate (PEM) instead")
	flags.StringVar(&f.clientCert, "tls-client-cert", "",
		"client certificate (PEM), for a server with --tls-client-ca")
	flags.StringVar(&f.clientKey, "tls-client-key", "", "the client certificate's private key (PEM)")
	flags.StringVar(&f.serverName, "tls-server-name", "", "the name to verify the server's certificate against")
	return f
}

// dialOption is the channel's security: grpc.WithInsecure() (grpc-go 1.33 predates credentials/insecure)
// when no flag is given, else TLS credentials. An error names the flag: a client certificate without its
// key, a file that cannot be read or holds no certificate or key.
func (f *tlsFlags) dialOption() (grpc.DialOption, error) {
	if (f.clientCert == "") != (f.clientKey == "") {
		return nil, errors.New("tls-client-cert: --tls-client-cert and --tls-client-key go together")
	}
	if !f.enabled && f.caCert == "" && f.clientCert == "" && f.serverName == "" {
		return grpc.WithInsecure(), nil
	}
	// An empty ServerName is the address's host; RootCAs nil is the system's roots.
	config := &tls.Config{ServerName: f.serverName}
	if f.caCert != "" {
		pem, err := readFlagFile("tls-ca-cert", f.caCert)
		if err != nil {
			return nil, err
		}
		config.RootCAs = x509.NewCertPool()
		if !config.RootCAs.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("tls-ca-cert: %s holds no PEM certificate", f.caCert)
		}
	}
	if f.clientCert != "" {
		certPEM, err := readFlagFile("tls-client-cert", f.clientCert)
		if err != nil {
			return nil, err
		}
		keyPEM, err := readFlagFile("tls-client-key", f.clientKey)
		if err != nil {
			return nil, err
		}
		pair, err := tls.X509KeyPair(certPEM, keyPEM)
		if err != nil {
			return nil, fmt.Errorf("tls-client-key: %s with %s: %v", f.clientKey, f.clientCert, err)
		}
		config.Certificates = []tls.Certificate{pair}
	}
	return grpc.WithTransportCredentials(credentials.NewTLS(config)), nil
}

// readFlagFile reads the file a flag names; an error names the flag, as Python's "cannot read PATH (reason)".
func readFlagFile(flagName, path string) ([]byte, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		var pathErr *os.PathError
		if errors.As(err, &pathErr) {
			err = pathErr.Err
		}
		return nil, fmt.Errorf("%s: cannot read %s (%v)", flagName, path, err)
	}
	return data, nil
}
