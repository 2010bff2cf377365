"""The Go and Java examples' runGenerate and runBidi, the functions a backend copies, end their call on
every return. They returned early (the Abort failed; a request of the StreamGenerate stream failed in-band)
with the call still open: grpc-go ends a stream only when its context is cancelled or it is read to an
error, grpc-java a blocking stub's call only when read to its end or its Context is cancelled, and an async
stub's when cancelled. So the request (or the stream's other requests) kept generating on the server,
holding its KV blocks, until the 120 s deadline. The examples exit on those errors, which hid it. Go:
clients/go's main_test.go checks each function against a stand-in server that holds the call open until the
client ends it; Java: a harness calls the functions against such a stand-in, holding its channel open."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import threading
from pathlib import Path

import grpc
import pytest
from service_harness import PATIENCE_S
from test_clients_go_java import CLIENTS, stand_in_server
from toolchains import REPO, require

from sluice.v1 import sluice_pb2 as pb
from sluice.v1 import sluice_pb2_grpc

PACKAGE = "github.com/sluice-ai/sluice/clients/go/cmd/sluice-example"


def test_go_example_functions_end_their_call_when_they_return_early() -> None:
    programs, _ = CLIENTS["go"]
    require(*programs)
    # The GOPATH that run_example.sh builds the example in: the repository as the proto's go_package.
    with tempfile.TemporaryDirectory() as gopath:
        os.makedirs(os.path.join(gopath, "src", "github.com", "sluice-ai"))
        os.symlink(REPO, os.path.join(gopath, "src", "github.com", "sluice-ai", "sluice"))
        env = {
            **os.environ,
            "GO111MODULE": "off",
            "GOPATH": f"{gopath}:/usr/share/gocode",
            "GOCACHE": os.path.join(REPO, "clients", "go", "build", "cache"),
        }
        result = subprocess.run(
            ["go", "test", "-count=1", "-v", PACKAGE], capture_output=True, text=True, env=env, timeout=540
        )
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    assert "--- PASS: TestRunGenerateEndsTheCallWhenAbortFails" in result.stdout
    assert "--- PASS: TestRunBidiEndsTheCallOnARequestError" in result.stdout


HARNESS = """
package ai.sluice.example;

import ai.sluice.v1.InferenceServiceGrpc;
import io.grpc.ManagedChannel;
import io.grpc.ManagedChannelBuilder;
import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.util.List;
import java.util.concurrent.TimeUnit;

/** Runs one of the example's functions into an error, then holds the channel open until stdin ends. */
public final class EarlyReturn {
  public static void main(String[] args) throws Exception {
    ManagedChannel channel = ManagedChannelBuilder.forTarget(args[0]).usePlaintext().build();
    try {
      try {
        if (args[1].equals("generate")) {
          SluiceExample.runGenerate(InferenceServiceGrpc.newBlockingStub(channel),
              SluiceExample.textRequest("r", "prompt", 100000), true);
        } else {
          SluiceExample.runBidi(InferenceServiceGrpc.newStub(channel), List.of(
              SluiceExample.textRequest("a", "prompt", 8), SluiceExample.textRequest("b", "prompt", 100000)),
              "b");
        }
        System.out.println("no error");
      } catch (Exception e) {
        System.out.println("returned: " + e);
      }
      System.out.flush();
      new BufferedReader(new InputStreamReader(System.in)).readLine();
    } finally {
      channel.shutdownNow().awaitTermination(5, TimeUnit.SECONDS);
    }
  }
}
"""


class _HoldsCallsOpen(sluice_pb2_grpc.InferenceServiceServicer):
    """Streams one chunk (Generate) or one in-band error (StreamGenerate), then holds the call open until
    the client ends it, as a Sluice request of many tokens does; `ended` is set then. Abort fails."""

    def __init__(self) -> None:
        self.ended = threading.Event()

    def _hold(self, context) -> None:
        done = threading.Event()
        context.add_callback(done.set)
        if done.wait(PATIENCE_S * 2):
            self.ended.set()

    def Generate(self, request, context):
        yield pb.GenerateResponse(request_id=request.request_id, text="a", token_ids=[1])
        self._hold(context)

    def Abort(self, request, context):
        context.abort(grpc.StatusCode.PERMISSION_DENIED, "not yours")

    def StreamGenerate(self, request_iterator, context):
        action = next(request_iterator)
        error = pb.RequestError(code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], message="full")
        yield pb.StreamGenerateResponse(request_id=action.generate.request_id, error=error)
        self._hold(context)


def _compile_harness(scratch: str) -> list[str]:
    """Builds the example as run_example.sh does (--help: it builds, then refuses the flag), then the
    harness beside it; the java command line that runs the harness."""
    programs, command = CLIENTS["java"]
    require(*programs, "bash")
    subprocess.run([command, "--help"], capture_output=True, timeout=540, check=False)
    script = Path(command).read_text()
    jars = re.search(r"^jars=\((.*?)\)", script, re.S | re.M).group(1).split()
    classes = os.path.join(REPO, "clients", "java", "build", "classes")
    classpath = ":".join([classes, scratch, *(f"/usr/share/java/{jar}.jar" for jar in jars)])
    source = Path(scratch, "EarlyReturn.java")
    source.write_text(HARNESS)
    subprocess.run(
        ["javac", "-nowarn", "-d", scratch, "-cp", classpath, str(source)], check=True, timeout=540
    )
    return ["java", "-cp", classpath, "ai.sluice.example.EarlyReturn"]


@pytest.mark.parametrize("function", ["generate", "bidi"])
def test_java_example_functions_end_their_call_when_they_return_early(function: str) -> None:
    """The same for the Java example's runGenerate and runBidi: the blocking stub's call and the async
    stub's stream stayed open after the function threw, until their 120 s deadline."""
    servicer = _HoldsCallsOpen()
    with tempfile.TemporaryDirectory() as scratch, stand_in_server(servicer) as target:
        java = _compile_harness(scratch)
        harness = subprocess.Popen(
            [*java, target, function], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        try:
            returned = harness.stdout.readline()
            assert returned.startswith("returned: "), returned
            # The harness holds its channel open: only the function's own cancel can end the call now.
            assert servicer.ended.wait(PATIENCE_S), "the call is still open after the function returned"
        finally:
            harness.communicate("\n", timeout=PATIENCE_S)
