// Command sluice-example talks to a Sluice server three ways: one Generate stream read to the end,
// one Generate stream aborted mid-stream with the Abort RPC, and two requests multiplexed on one
// bidirectional StreamGenerate stream, the second cancelled in-band after its first chunk.
//
// Every result is one line, `<kind>: request_id=... finish=... tokens=N ...`, then `done`.
//
// --api-key KEY (default: $SLUICE_API_KEY) sends `authorization: Bearer KEY` on every call, for a server
// started with --api-key or --api-keys.
//
// TLS takes the flags of Sluice's Python clients (tls_flags.go), plaintext unless one is given: --tls
// trusts the system's roots; --tls-ca-cert CA.pem trusts that CA instead (a server's --tls-cert signed by
// it); --tls-client-cert C.pem --tls-client-key K.pem (together) present a client certificate, for a
// server started with --tls-client-ca; --tls-server-name NAME verifies the server's certificate against
// NAME rather than the address's host. A client certificate without its key, or a file that cannot be
// read, exits 1 naming the flag.
//
// --session ID turns on session affinity: the ring-hash service config below and the header
// x-sluice-session: ID on every call, so all of them reach the replica ID hashes to (docs/FLEET.md).
// That needs grpc-go 1.73 or newer built with `-tags ringhash` (ringhash.go registers the policy) and,
// until the release that turns it on by default (grpc/grpc-go#8922),
// GRPC_EXPERIMENTAL_RING_HASH_SET_REQUEST_HASH_KEY=true; Debian 12's grpc-go 1.33 has no ring hash.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log"
	"os"
	"strings"
	"time"

	sluicev1 "github.com/sluice-ai/sluice/clients/go/sluice/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	// Registers client-side health checking, which the service config's healthCheckConfig turns on.
	_ "google.golang.org/grpc/health"
)

// serviceConfig is Sluice's documented client service config (docs/OPERATIONS.md "Kubernetes with N
// replicas", sluice.service_config in Python): round robin over every address of the target, replicas
// that are NOT_SERVING (loading, draining) left out, UNAVAILABLE retried (grpc-go < 1.40:
// GRPC_GO_RETRY=on).
const serviceConfig = `{
  "loadBalancingConfig": [{"round_robin": {}}],
  "healthCheckConfig": {"serviceName": "sluice.v1.InferenceService"},
  "methodConfig": [{
    "name": [{"service": "sluice.v1.InferenceService"}],
    "retryPolicy": {
      "maxAttempts": 5,
      "initialBackoff": "0.1s",
      "maxBackoff": "1s",
      "backoffMultiplier": 2,
      "retryableStatusCodes": ["UNAVAILABLE"]
    }
  }]
}`

// sessionHeader carries a conversation's id; sessionServiceConfig is serviceConfig with calls placed
// on a hash ring by that header's value (gRFC A76; sluice.service_config.SESSION_AFFINITY_SERVICE_CONFIG).
const sessionHeader = "x-sluice-session"

const sessionServiceConfig = `{
  "loadBalancingConfig": [{"ring_hash_experimental": {"requestHashHeader": "x-sluice-session"}}],
  "healthCheckConfig": {"serviceName": "sluice.v1.InferenceService"},
  "methodConfig": [{
    "name": [{"service": "sluice.v1.InferenceService"}],
    "retryPolicy": {
      "maxAttempts": 5,
      "initialBackoff": "0.1s",
      "maxBackoff": "1s",
      "backoffMultiplier": 2,
      "retryableStatusCodes": ["UNAVAILABLE"]
    }
  }]
}`

// result is what one request streamed back.
type result struct {
	text     strings.Builder
	tokenIDs []int32
	finish   sluicev1.FinishReason
}

func (r *result) add(chunk *sluicev1.GenerateResponse) {
	r.text.WriteString(chunk.GetText())
	r.tokenIDs = append(r.tokenIDs, chunk.GetTokenIds()...)
	if chunk.GetFinishReason() != sluicev1.FinishReason_FINISH_REASON_UNSPECIFIED {
		r.finish = chunk.GetFinishReason()
	}
}

func (r *result) print(kind, requestID string) {
	ids := make([]string, len(r.tokenIDs))
	for i, id := range r.tokenIDs {
		ids[i] = fmt.Sprint(id)
	}
	text := r.text.String()
	fmt.Printf("%s: request_id=%s finish=%s tokens=%d text_bytes=%d token_ids=[%s] text=%q\n",
		kind, requestID, r.finish, len(r.tokenIDs), len(text), strings.Join(ids, ","), text)
}

// greedy samples the most likely token maxTokens times, past any EOS, so the length is exact.
func greedy(maxTokens int32) *sluicev1.SamplingParams {
	temperature, ignoreEOS := float32(0), true
	return &sluicev1.SamplingParams{Temperature: &temperature, MaxTokens: &maxTokens, IgnoreEos: &ignoreEOS}
}

func textRequest(requestID, prompt string, maxTokens int32) *sluicev1.GenerateRequest {
	return &sluicev1.GenerateRequest{
		RequestId:      requestID,
		Prompt:         &sluicev1.GenerateRequest_Text{Text: prompt},
		SamplingParams: greedy(maxTokens),
	}
}

// runGenerate reads one Generate stream to its end; abortAfterFirst aborts it after its first chunk.
func runGenerate(ctx context.Context, client sluicev1.InferenceServiceClient,
	req *sluicev1.GenerateRequest, abortAfterFirst bool) (*result, error) {
	// Every return cancels the call: one that returns before the stream's end (the Abort failed) ends the
	// request on the server too, instead of leaving it generating until ctx's deadline (grpc-go's
	// ClientConn.NewStream: cancel the context, or read until an error, or the stream leaks).
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := client.Generate(ctx, req)
	if err != nil {
		return nil, err
	}
	res := &result{}
	for {
		chunk, err := stream.Recv()
		if err == io.EOF {
			return res, nil
		}
		if err != nil {
			return nil, err
		}
		res.add(chunk)
		if abortAfterFirst && len(res.tokenIDs) > 0 {
			abortAfterFirst = false
			if _, err := client.Abort(ctx, &sluicev1.AbortRequest{RequestId: req.RequestId}); err != nil {
				return nil, fmt.Errorf("abort: %w", err)
			}
		}
	}
}

func generateAction(req *sluicev1.GenerateRequest) *sluicev1.StreamGenerateRequest {
	return &sluicev1.StreamGenerateRequest{Action: &sluicev1.StreamGenerateRequest_Generate{Generate: req}}
}

func cancelAction(requestID string) *sluicev1.StreamGenerateRequest {
	return &sluicev1.StreamGenerateRequest{
		Action: &sluicev1.StreamGenerateRequest_Cancel{Cancel: &sluicev1.StreamCancel{RequestId: requestID}},
	}
}

// runBidi starts both requests on one StreamGenerate stream, cancels `cancelled` after its first
// chunk and half-closes, then reads until the server ends the stream.
func runBidi(ctx context.Context, client sluicev1.InferenceServiceClient,
	requests []*sluicev1.GenerateRequest, cancelled string) (map[string]*result, error) {
	// As in runGenerate: returning on a request's error ends the call, and with it the stream's other
	// requests, which would otherwise keep generating on the server.
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := client.StreamGenerate(ctx)
	if err != nil {
		return nil, err
	}
	results := map[string]*result{}
	for _, req := range requests {
		results[req.RequestId] = &result{}
		if err := stream.Send(generateAction(req)); err != nil {
			return nil, err
		}
	}
	sentCancel := false
	for {
		event, err := stream.Recv()
		if err == io.EOF {
			return results, nil
		}
		if err != nil {
			return nil, err
		}
		if e := event.GetError(); e != nil {
			return nil, fmt.Errorf("request %s failed: code=%d %s", event.GetRequestId(), e.GetCode(), e.GetMessage())
		}
		results[event.GetRequestId()].add(event.GetChunk())
		if !sentCancel && event.GetRequestId() == cancelled {
			sentCancel = true
			if err := stream.Send(cancelAction(cancelled)); err != nil {
				return nil, err
			}
			if err := stream.CloseSend(); err != nil {
				return nil, err
			}
		}
	}
}

func main() {
	addr := flag.String("addr", "localhost:50051", "Sluice server host:port")
	prompt := flag.String("prompt", "The quick brown fox", "prompt text")
	maxTokens := flag.Int("max-tokens", 8, "tokens generated by the requests read to the end")
	longTokens := flag.Int("long-tokens", 0,
		"max_tokens of the requests cancelled mid-stream (0: what the context, or the KV cache where it "+
			"holds less, leaves beside the prompt, so they still run when cancelled)")
	session := flag.String("session", "", "send every call with this session id (ring-hash affinity)")
	apiKey := flag.String("api-key", os.Getenv("SLUICE_API_KEY"),
		"send 'authorization: Bearer KEY' on every call (default: $SLUICE_API_KEY)")
	tlsArgs := addTLSFlags(flag.CommandLine)
	flag.Parse()
	security, err := tlsArgs.dialOption()
	if err != nil {
		log.Fatal(err)
	}

	config := serviceConfig
	if *session != "" {
		config = sessionServiceConfig
	}

	dialCtx, cancelDial := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancelDial()
	// WithReturnConnectionError blocks as WithBlock does and, when the dial times out, says why the last
	// connection failed (a TLS handshake's error, say), not only "context deadline exceeded".
	conn, err := grpc.DialContext(dialCtx, *addr, security, grpc.WithReturnConnectionError(),
		grpc.WithDefaultServiceConfig(config))
	if err != nil {
		log.Fatalf("dial %s: %v", *addr, err)
	}
	defer conn.Close()
	client := sluicev1.NewInferenceServiceClient(conn)
	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
	defer cancel()
	if *session != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, sessionHeader, *session)
	}
	if *apiKey != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+*apiKey)
	}

	info, err := client.GetModelInfo(ctx, &sluicev1.GetModelInfoRequest{})
	if err != nil {
		log.Fatalf("get model info: %v", err)
	}
	fmt.Printf("model: name=%s max_model_len=%d\n", info.GetModelName(), info.GetMaxModelLen())
	if *longTokens == 0 {
		tokens, err := client.Tokenize(ctx, &sluicev1.TokenizeRequest{
			Prompt: &sluicev1.TokenizeRequest_Text{Text: *prompt}})
		if err != nil {
			log.Fatalf("tokenize: %v", err)
		}
		// The KV cache may hold less than one request of max_model_len (the server warns at start, and
		// refuses a request needing more blocks than it has): then the room is what the cache holds.
		room := int64(info.GetMaxModelLen())
		if capacity := info.GetKvCapacityTokens(); capacity > 0 && capacity < room {
			room = capacity
		}
		*longTokens = int(room) - len(tokens.GetTokenIds())
	}

	res, err := runGenerate(ctx, client, textRequest("go-generate", *prompt, int32(*maxTokens)), false)
	if err != nil {
		log.Fatalf("generate: %v", err)
	}
	res.print("generate", "go-generate")

	res, err = runGenerate(ctx, client, textRequest("go-abort", *prompt, int32(*longTokens)), true)
	if err != nil {
		log.Fatalf("generate with abort: %v", err)
	}
	res.print("abort", "go-abort")

	requests := []*sluicev1.GenerateRequest{
		textRequest("go-bidi-0", *prompt, int32(*maxTokens)),
		textRequest("go-bidi-1", *prompt, int32(*longTokens)),
	}
	results, err := runBidi(ctx, client, requests, "go-bidi-1")
	if err != nil {
		log.Fatalf("stream generate: %v", err)
	}
	for _, req := range requests {
		results[req.RequestId].print("bidi", req.RequestId)
	}
	fmt.Println("done")
}
