package main

import (
	"context"
	"errors"
	"net"
	"testing"
	"time"

	sluicev1 "github.com/sluice-ai/sluice/clients/go/sluice/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// patience is how long a test waits for something that must happen: only a hang takes this long.
const patience = 60 * time.Second

// standIn streams one chunk (Generate) or one in-band error (StreamGenerate), then holds the call open
// until the client ends it, as a Sluice request of many tokens does; ended is closed then. Abort fails.
type standIn struct {
	sluicev1.UnimplementedInferenceServiceServer
	ended chan struct{}
}

func (s *standIn) Generate(req *sluicev1.GenerateRequest, stream sluicev1.InferenceService_GenerateServer) error {
	defer close(s.ended)
	chunk := &sluicev1.GenerateResponse{RequestId: req.GetRequestId(), Text: "a", TokenIds: []int32{1}}
	if err := stream.Send(chunk); err != nil {
		return err
	}
	<-stream.Context().Done()
	return nil
}

func (s *standIn) Abort(context.Context, *sluicev1.AbortRequest) (*sluicev1.AbortResponse, error) {
	return nil, status.Error(codes.PermissionDenied, "not yours")
}

func (s *standIn) StreamGenerate(stream sluicev1.InferenceService_StreamGenerateServer) error {
	defer close(s.ended)
	action, err := stream.Recv()
	if err != nil {
		return err
	}
	failed := &sluicev1.StreamGenerateResponse{
		RequestId: action.GetGenerate().GetRequestId(),
		Event:     &sluicev1.StreamGenerateResponse_Error{Error: &sluicev1.RequestError{Code: 8, Message: "full"}},
	}
	if err := stream.Send(failed); err != nil {
		return err
	}
	<-stream.Context().Done()
	return nil
}

// dial serves a standIn on a loopback port; the returned function stops both ends.
func dial(t *testing.T) (*standIn, sluicev1.InferenceServiceClient, func()) {
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	server := grpc.NewServer()
	stand := &standIn{ended: make(chan struct{})}
	sluicev1.RegisterInferenceServiceServer(server, stand)
	go server.Serve(listener)
	conn, err := grpc.Dial(listener.Addr().String(), grpc.WithInsecure())
	if err != nil {
		server.Stop()
		t.Fatal(err)
	}
	return stand, sluicev1.NewInferenceServiceClient(conn), func() { conn.Close(); server.Stop() }
}

// waitEnded fails unless the stand-in saw its call end while the connection is still open.
func waitEnded(t *testing.T, stand *standIn) {
	select {
	case <-stand.ended:
	case <-time.After(patience):
		t.Fatal("the call is still open on the server after the function returned")
	}
}

func TestRunGenerateEndsTheCallWhenAbortFails(t *testing.T) {
	stand, client, stop := dial(t)
	defer stop()
	_, err := runGenerate(context.Background(), client, textRequest("r", "prompt", 100000), true)
	// (grpc-go 1.33's status.Code does not unwrap.)
	if status.Code(errors.Unwrap(err)) != codes.PermissionDenied {
		t.Fatalf("runGenerate: %v, want the Abort's PermissionDenied", err)
	}
	waitEnded(t, stand)
}

func TestRunBidiEndsTheCallOnARequestError(t *testing.T) {
	stand, client, stop := dial(t)
	defer stop()
	requests := []*sluicev1.GenerateRequest{textRequest("a", "prompt", 8), textRequest("b", "prompt", 100000)}
	if _, err := runBidi(context.Background(), client, requests, "b"); err == nil {
		t.Fatal("runBidi: no error for the request that failed in-band")
	}
	waitEnded(t, stand)
}
