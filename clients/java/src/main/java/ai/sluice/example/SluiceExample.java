package ai.sluice.example;

import ai.sluice.v1.AbortRequest;
import ai.sluice.v1.FinishReason;
import ai.sluice.v1.GenerateRequest;
import ai.sluice.v1.GenerateResponse;
import ai.sluice.v1.GetModelInfoRequest;
import ai.sluice.v1.GetModelInfoResponse;
import ai.sluice.v1.InferenceServiceGrpc;
import ai.sluice.v1.SamplingParams;
import ai.sluice.v1.StreamCancel;
import ai.sluice.v1.StreamGenerateRequest;
import ai.sluice.v1.StreamGenerateResponse;
import ai.sluice.v1.TokenizeRequest;
import ai.sluice.v1.TokenizeResponse;
import io.grpc.ClientInterceptor;
import io.grpc.Context;
import io.grpc.ManagedChannel;
import io.grpc.Metadata;
import io.grpc.Status;
import io.grpc.StatusRuntimeException;
import io.grpc.stub.MetadataUtils;
import io.grpc.stub.StreamObserver;
import java.util.ArrayList;
import java.util.Iterator;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.concurrent.Callable;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.TimeUnit;
import java.util.stream.Collectors;

/**
 * Talks to a Sluice server three ways: one Generate stream read to the end, one Generate stream
 * aborted mid-stream with the Abort RPC, and two requests multiplexed on one bidirectional
 * StreamGenerate stream, the second cancelled in-band after its first chunk.
 *
 * <p>Every result is one line, {@code <kind>: request_id=... finish=... tokens=N ...}, then {@code done}.
 * Arguments: {@code --addr host:port --prompt TEXT --max-tokens N --long-tokens N --session ID
 * --api-key KEY} and the TLS flags below; a {@code --long-tokens} of 0 (the default) is what the context
 * (or the KV cache, where it holds less) leaves beside the prompt, so the requests cancelled mid-stream
 * are still running when cancelled.
 *
 * <p>TLS takes the flags of Sluice's Python clients ({@link TlsFlags}), plaintext unless one is given:
 * {@code --tls} trusts the system's roots; {@code --tls-ca-cert CA.pem} trusts that CA instead (a
 * server's --tls-cert signed by it); {@code --tls-client-cert C.pem --tls-client-key K.pem} (together,
 * a PKCS#8 key) present a client certificate, for a server started with --tls-client-ca;
 * {@code --tls-server-name NAME} verifies the server's certificate against NAME rather than the
 * address's host. A client certificate without its key, or a file that cannot be read, exits 1 naming
 * the flag.
 *
 * <p>{@code --session ID} turns on session affinity (docs/FLEET.md): the ring-hash service config
 * ({@link #sessionServiceConfig}) and the header {@code x-sluice-session: ID} on every call, so all of
 * them reach the replica ID hashes to. That needs a grpc-java whose ring_hash_experimental policy
 * (grpc-xds on the classpath) reads requestHashHeader (gRFC A76, grpc/grpc-java#11881); Debian 12's
 * grpc-java 1.41 used by run_example.sh has neither, so leave the flag out there.
 */
public final class SluiceExample {
  private SluiceExample() {}

  /** What one request streamed back. */
  static final class Result {
    final StringBuilder text = new StringBuilder();
    final List<Integer> tokenIds = new ArrayList<>();
    FinishReason finish = FinishReason.FINISH_REASON_UNSPECIFIED;

    void add(GenerateResponse chunk) {
      text.append(chunk.getText());
      tokenIds.addAll(chunk.getTokenIdsList());
      if (chunk.getFinishReason() != FinishReason.FINISH_REASON_UNSPECIFIED) {
        finish = chunk.getFinishReason();
      }
    }

    void print(String kind, String requestId) {
      String ids = tokenIds.stream().map(String::valueOf).collect(Collectors.joining(","));
      String body = text.toString();
      int textBytes = body.getBytes(java.nio.charset.StandardCharsets.UTF_8).length;
      System.out.printf("%s: request_id=%s finish=%s tokens=%d text_bytes=%d token_ids=[%s] text=%s%n",
          kind, requestId, finish, tokenIds.size(), textBytes, ids, quote(body));
    }

    /**
     * The text quoted as the Go example's %q quotes it: a generated line break or other control
     * character, quote or backslash is escaped, so that every result stays on one line.
     */
    static String quote(String text) {
      StringBuilder quoted = new StringBuilder("\"");
      text.codePoints().forEach(c -> {
        switch (c) {
          case 0x07 -> quoted.append("\\a");
          case '\b' -> quoted.append("\\b");
          case '\f' -> quoted.append("\\f");
          case '\n' -> quoted.append("\\n");
          case '\r' -> quoted.append("\\r");
          case '\t' -> quoted.append("\\t");
          case 0x0b -> quoted.append("\\v");
          case '"', '\\' -> quoted.append('\\').appendCodePoint(c);
          default -> {
            if (c < 0x20 || c == 0x7f) {
              quoted.append(String.format("\\x%02x", c));
            } else if (Character.isISOControl(c) || c == 0x2028 || c == 0x2029) {
              quoted.append(String.format("\\u%04x", c));
            } else {
              quoted.appendCodePoint(c);
            }
          }
        }
      });
      return quoted.append('"').toString();
    }
  }

  /** Greedy sampling of exactly maxTokens tokens, past any EOS. */
  static GenerateRequest textRequest(String requestId, String prompt, int maxTokens) {
    SamplingParams params = SamplingParams.newBuilder()
        .setTemperature(0f).setMaxTokens(maxTokens).setIgnoreEos(true).build();
    return GenerateRequest.newBuilder()
        .setRequestId(requestId).setText(prompt).setSamplingParams(params).build();
  }

  /**
   * Reads one Generate stream to its end; abortAfterFirst aborts it after its first chunk. Every return
   * cancels the call: one that leaves before the stream's end (the Abort failed) ends the request on the
   * server too, instead of leaving it generating until the deadline (a blocking stub's call ends only when
   * read to its end or when its Context is cancelled).
   */
  static Result runGenerate(InferenceServiceGrpc.InferenceServiceBlockingStub stub,
      GenerateRequest request, boolean abortAfterFirst) throws Exception {
    return cancelledOnReturn(() -> readGenerate(stub, request, abortAfterFirst));
  }

  /**
   * Runs {@code body} in a cancellable gRPC Context and cancels it on every return, normal or thrown: a
   * call the body started and did not finish ends on the server too.
   */
  static <T> T cancelledOnReturn(Callable<T> body) throws Exception {
    Context.CancellableContext call = Context.current().withCancellation();
    try {
      return call.call(body);
    } finally {
      call.cancel(null);
    }
  }

  private static Result readGenerate(InferenceServiceGrpc.InferenceServiceBlockingStub stub,
      GenerateRequest request, boolean abortAfterFirst) {
    Result result = new Result();
    Iterator<GenerateResponse> chunks = stub.withDeadlineAfter(120, TimeUnit.SECONDS).generate(request);
    while (chunks.hasNext()) {
      result.add(chunks.next());
      if (abortAfterFirst && !result.tokenIds.isEmpty()) {
        abortAfterFirst = false;
        stub.abort(AbortRequest.newBuilder().setRequestId(request.getRequestId()).build());
      }
    }
    return result;
  }

  /**
   * Starts the requests on one StreamGenerate stream, cancels {@code cancelled} after its first chunk
   * and half-closes, then waits until the server ends the stream. As in runGenerate, every return
   * cancels the call: one on a request's error ends the stream's other requests on the server too.
   */
  static Map<String, Result> runBidi(InferenceServiceGrpc.InferenceServiceStub stub,
      List<GenerateRequest> requests, String cancelled) throws Exception {
    return cancelledOnReturn(() -> streamBidi(stub, requests, cancelled));
  }

  private static Map<String, Result> streamBidi(InferenceServiceGrpc.InferenceServiceStub stub,
      List<GenerateRequest> requests, String cancelled) throws Exception {
    Map<String, Result> results = new LinkedHashMap<>();
    requests.forEach(r -> results.put(r.getRequestId(), new Result()));
    CompletableFuture<Void> ended = new CompletableFuture<>();
    // The request side is written from this thread and from gRPC's callback thread: guard it.
    Object sendLock = new Object();
    List<StreamObserver<StreamGenerateRequest>> sender = new ArrayList<>();
    StreamObserver<StreamGenerateResponse> receiver = new StreamObserver<>() {
      private boolean sentCancel;

      @Override
      public void onNext(StreamGenerateResponse event) {
        if (event.hasError()) {
          ended.completeExceptionally(new IllegalStateException("request " + event.getRequestId()
              + " failed: code=" + event.getError().getCode() + " " + event.getError().getMessage()));
          return;
        }
        results.get(event.getRequestId()).add(event.getChunk());
        if (!sentCancel && event.getRequestId().equals(cancelled)) {
          sentCancel = true;
          synchronized (sendLock) {
            StreamCancel cancel = StreamCancel.newBuilder().setRequestId(cancelled).build();
            sender.get(0).onNext(StreamGenerateRequest.newBuilder().setCancel(cancel).build());
            sender.get(0).onCompleted();
          }
        }
      }

      @Override
      public void onError(Throwable t) {
        ended.completeExceptionally(t);
      }

      @Override
      public void onCompleted() {
        ended.complete(null);
      }
    };
    synchronized (sendLock) {
      sender.add(stub.withDeadlineAfter(120, TimeUnit.SECONDS).streamGenerate(receiver));
      for (GenerateRequest request : requests) {
        sender.get(0).onNext(StreamGenerateRequest.newBuilder().setGenerate(request).build());
      }
    }
    ended.get(120, TimeUnit.SECONDS);
    return results;
  }

  /**
   * Sluice's documented client service config (docs/OPERATIONS.md "Kubernetes with N replicas",
   * sluice.service_config in Python) as the Map grpc-java takes (numbers as Double): round robin over
   * every address of the target, UNAVAILABLE retried; healthCheckConfig takes effect where grpc-services
   * is on the classpath (it is not among Debian's jars used here).
   */
  static Map<String, ?> serviceConfig() {
    Map<String, Object> retryPolicy = Map.of(
        "maxAttempts", 5.0,
        "initialBackoff", "0.1s",
        "maxBackoff", "1s",
        "backoffMultiplier", 2.0,
        "retryableStatusCodes", List.of("UNAVAILABLE"));
    Map<String, Object> methodConfig = Map.of(
        "name", List.of(Map.of("service", "sluice.v1.InferenceService")),
        "retryPolicy", retryPolicy);
    return Map.of(
        "loadBalancingConfig", List.of(Map.of("round_robin", Map.of())),
        "healthCheckConfig", Map.of("serviceName", "sluice.v1.InferenceService"),
        "methodConfig", List.of(methodConfig));
  }

  /** The request header whose value places a call on the hash ring. */
  static final String SESSION_HEADER = "x-sluice-session";

  /**
   * serviceConfig() with calls placed on a hash ring by the value of the x-sluice-session header
   * (sluice.service_config.SESSION_AFFINITY_SERVICE_CONFIG in Python).
   */
  static Map<String, ?> sessionServiceConfig() {
    Map<String, Object> config = new LinkedHashMap<>(serviceConfig());
    config.put("loadBalancingConfig",
        List.of(Map.of("ring_hash_experimental", Map.of("requestHashHeader", SESSION_HEADER))));
    return config;
  }

  /** Adds x-sluice-session: session to every call of a stub. */
  static ClientInterceptor sessionHeader(String session) {
    return header(SESSION_HEADER, session);
  }

  /** Adds the header {@code name: value} to every call of a stub. */
  static ClientInterceptor header(String name, String value) {
    Metadata headers = new Metadata();
    headers.put(Metadata.Key.of(name, Metadata.ASCII_STRING_MARSHALLER), value);
    return MetadataUtils.newAttachHeadersInterceptor(headers);
  }

  /**
   * Reads {@code args} into {@code flags} (each {@code --flag value}, but {@code --tls} alone) and says
   * whether {@code --tls} was given. IllegalArgumentException: an unknown flag, one without its value.
   */
  static boolean parseFlags(String[] args, Map<String, String> flags) {
    boolean tls = false;
    for (int i = 0; i < args.length; i++) {
      if (args[i].equals(TlsFlags.TLS)) {
        tls = true;
      } else if (!flags.containsKey(args[i])) {
        throw new IllegalArgumentException("unknown flag " + args[i] + "; known: " + flags.keySet()
            + " and " + TlsFlags.TLS);
      } else if (i + 1 == args.length) {
        throw new IllegalArgumentException(args[i].substring(2) + ": " + args[i] + " takes a value");
      } else {
        flags.put(args[i], args[++i]);
      }
    }
    return tls;
  }

  /**
   * GetModelInfo, waiting up to 10 s for the connection as the Go example's dial does. When the wait
   * runs out, one call that does not wait says why the connection failed (UNAVAILABLE caused by a TLS
   * handshake's error, say), which the waiting call's DEADLINE_EXCEEDED does not.
   */
  static GetModelInfoResponse firstCall(InferenceServiceGrpc.InferenceServiceBlockingStub stub) {
    GetModelInfoRequest request = GetModelInfoRequest.getDefaultInstance();
    try {
      return stub.withDeadlineAfter(10, TimeUnit.SECONDS).withWaitForReady().getModelInfo(request);
    } catch (StatusRuntimeException e) {
      if (e.getStatus().getCode() != Status.Code.DEADLINE_EXCEEDED) {
        throw e;
      }
      return stub.withDeadlineAfter(10, TimeUnit.SECONDS).getModelInfo(request);
    }
  }

  public static void main(String[] args) throws Exception {
    Map<String, String> flags = new LinkedHashMap<>(Map.of(
        "--addr", "localhost:50051", "--prompt", "The quick brown fox",
        "--max-tokens", "8", "--long-tokens", "0", "--session", "",
        // authorization: Bearer KEY on every call, for a server started with --api-key or --api-keys.
        "--api-key", System.getenv().getOrDefault("SLUICE_API_KEY", "")));
    TlsFlags.VALUE_FLAGS.forEach(flag -> flags.put(flag, ""));
    String session;
    ManagedChannel channel;
    try {  // a bad flag: its message, and exit status 1
      boolean tls = parseFlags(args, flags);
      session = flags.get("--session");
      channel = TlsFlags.of(tls, flags).channelBuilder(flags.get("--addr"))
          .defaultServiceConfig(session.isEmpty() ? serviceConfig() : sessionServiceConfig())
          .enableRetry()
          .build();
    } catch (IllegalArgumentException e) {
      System.err.println("sluice-example: " + e.getMessage());
      System.exit(1);
      return;
    }
    String prompt = flags.get("--prompt");
    int maxTokens = Integer.parseInt(flags.get("--max-tokens"));
    int longTokens = Integer.parseInt(flags.get("--long-tokens"));

    try {
      var blocking = InferenceServiceGrpc.newBlockingStub(channel);
      var async = InferenceServiceGrpc.newStub(channel);
      if (!session.isEmpty()) {
        blocking = blocking.withInterceptors(sessionHeader(session));
        async = async.withInterceptors(sessionHeader(session));
      }
      String apiKey = flags.get("--api-key");
      if (!apiKey.isEmpty()) {
        blocking = blocking.withInterceptors(header("authorization", "Bearer " + apiKey));
        async = async.withInterceptors(header("authorization", "Bearer " + apiKey));
      }
      GetModelInfoResponse info = firstCall(blocking);
      System.out.printf("model: name=%s max_model_len=%d%n", info.getModelName(), info.getMaxModelLen());
      if (longTokens == 0) {  // what the context leaves beside the prompt: still running when cancelled
        TokenizeResponse tokens = blocking.withDeadlineAfter(10, TimeUnit.SECONDS)
            .tokenize(TokenizeRequest.newBuilder().setText(prompt).build());
        // The KV cache may hold less than one request of max_model_len (the server warns at start, and
        // refuses a request needing more blocks than it has): then the room is what the cache holds.
        long room = info.getMaxModelLen();
        if (info.getKvCapacityTokens() > 0) {
          room = Math.min(room, info.getKvCapacityTokens());
        }
        longTokens = (int) room - tokens.getTokenIdsCount();
      }

      runGenerate(blocking, textRequest("java-generate", prompt, maxTokens), false)
          .print("generate", "java-generate");
      runGenerate(blocking, textRequest("java-abort", prompt, longTokens), true)
          .print("abort", "java-abort");

      List<GenerateRequest> requests = List.of(
          textRequest("java-bidi-0", prompt, maxTokens), textRequest("java-bidi-1", prompt, longTokens));
      Map<String, Result> results = runBidi(async, requests, "java-bidi-1");
      results.forEach((requestId, result) -> result.print("bidi", requestId));
      System.out.println("done");
    } finally {
      channel.shutdownNow().awaitTermination(5, TimeUnit.SECONDS);
    }
  }
}
