//go:build ringhash

// Session affinity (--session) needs the ring_hash_experimental policy registered: grpc-go 1.73 or newer,
// built with `go build -tags ringhash`.
package main

import (
	_ "google.golang.org/grpc/balancer/ringhash"
)
