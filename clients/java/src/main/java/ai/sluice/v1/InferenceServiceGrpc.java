package ai.sluice.v1;

import static io.grpc.MethodDescriptor.generateFullMethodName;

/**
 * <pre>
 * InferenceService generates text from one model held by the server.
 * </pre>
 */
@javax.annotation.Generated(
    value = "by gRPC proto compiler",
    comments = "Source: sluice/v1/sluice.proto")
@io.grpc.stub.annotations.GrpcGenerated
public final class InferenceServiceGrpc {

  private InferenceServiceGrpc() {}

  public static final String SERVICE_NAME = "sluice.v1.InferenceService";

  // Static method descriptors that strictly reflect the proto.
  private static volatile io.grpc.MethodDescriptor<ai.sluice.v1.GenerateRequest,
      ai.sluice.v1.GenerateResponse> getGenerateMethod;

  @io.grpc.stub.annotations.RpcMethod(
      fullMethodName = SERVICE_NAME + '/' + "Generate",
      requestType = ai.sluice.v1.GenerateRequest.class,
      responseType = ai.sluice.v1.GenerateResponse.class,
      methodType = io.grpc.MethodDescriptor.MethodType.SERVER_STREAMING)
  public static io.grpc.MethodDescriptor<ai.sluice.v1.GenerateRequest,
      ai.sluice.v1.GenerateResponse> getGenerateMethod() {
    io.grpc.MethodDescriptor<ai.sluice.v1.GenerateRequest, ai.sluice.v1.GenerateResponse> getGenerateMethod;
    if ((getGenerateMethod = InferenceServiceGrpc.getGenerateMethod) == null) {
      synchronized (InferenceServiceGrpc.class) {
        if ((getGenerateMethod = InferenceServiceGrpc.getGenerateMethod) == null) {
          InferenceServiceGrpc.getGenerateMethod = getGenerateMethod =
              io.grpc.MethodDescriptor.<ai.sluice.v1.GenerateRequest, ai.sluice.v1.GenerateResponse>newBuilder()
              .setType(io.grpc.MethodDescriptor.MethodType.SERVER_STREAMING)
              .setFullMethodName(generateFullMethodName(SERVICE_NAME, "Generate"))
              .setSampledToLocalTracing(true)
              .setRequestMarshaller(io.grpc.protobuf.ProtoUtils.marshaller(
                  ai.sluice.v1.GenerateRequest.getDefaultInstance()))
              .setResponseMarshaller(io.grpc.protobuf.ProtoUtils.marshaller(
                  ai.sluice.v1.GenerateResponse.getDefaultInstance()))
              .setSchemaDescriptor(new InferenceServiceMethodDescriptorSupplier("Generate"))
              .build();
        }
      }
    }
    return getGenerateMethod;
  }

  private static volatile io.grpc.MethodDescriptor<ai.sluice.v1.StreamGenerateRequest,
      ai.sluice.v1.StreamGenerateResponse> getStreamGenerateMethod;

  @io.grpc.stub.annotations.RpcMethod(
      fullMethodName = SERVICE_NAME + '/' + "StreamGenerate",
      requestType = ai.sluice.v1.StreamGenerateRequest.class,
      responseType = ai.sluice.v1.StreamGenerateResponse.class,
      methodType = io.grpc.MethodDescriptor.MethodType.BIDI_STREAMING)
  public static io.grpc.MethodDescriptor<ai.sluice.v1.StreamGenerateRequest,
      ai.sluice.v1.StreamGenerateResponse> getStreamGenerateMethod() {
    io.grpc.MethodDescriptor<ai.sluice.v1.StreamGenerateRequest, ai.sluice.v1.StreamGenerateResponse> getStreamGenerateMethod;
    if ((getStreamGenerateMethod = InferenceServiceGrpc.getStreamGenerateMethod) == null) {
      synchronized (InferenceServiceGrpc.class) {
        if ((getStreamGenerateMethod = InferenceServiceGrpc.getStreamGenerateMethod) == null) {
          InferenceServiceGrpc.getStreamGenerateMethod = getStreamGenerateMethod =
              io.grpc.MethodDescriptor.<ai.sluice.v1.StreamGenerateRequest, ai.sluice.v1.StreamGenerateResponse>newBuilder()
              .setType(io.grpc.MethodDescriptor.MethodType.BIDI_STREAMING)
              .setFullMethodName(generateFullMethodName(SERVICE_NAME, "StreamGenerate"))
              .setSampledToLocalTracing(true)
              .setRequestMarshaller(io.grpc.protobuf.ProtoUtils.marshaller(
                  ai.sluice.v1.StreamGenerateRequest.getDefaultInstance()))
              .setResponseMarshaller(io.grpc.protobuf.ProtoUtils.marshaller(
                  ai.sluice.v1.StreamGenerateResponse.getDefaultInstance()))
              .setSchemaDescriptor(new InferenceServiceMethodDescriptorSupplier("StreamGenerate"))
              .build();
        }
      }
    }
    return getStreamGenerateMethod;
  }

  private static volatile io.grpc.MethodDescriptor<ai.sluice.v1.AbortRequest,
      ai.sluice.v1.AbortResponse> getAbortMethod;

  @io.grpc.stub.annotations.RpcMethod(
      fullMethodName = SERVICE_NAME + '/' + "Abort",
      requestType = ai.sluice.v1.AbortRequest.class,
      responseType = ai.sluice.v1.AbortResponse.class,
      methodType = io.grpc.MethodDescriptor.MethodType.UNARY)
  public static io.grpc.MethodDescriptor<ai.sluice.v1.AbortRequest,
      ai.sluice.v1.AbortResponse> getAbortMethod() {
    io.grpc.MethodDescriptor<ai.sluice.v1.AbortRequest, ai.sluice.v1.AbortResponse> getAbortMethod;
    if ((getAbortMethod = InferenceServiceGrpc.getAbortMethod) == null) {
      synchronized (InferenceServiceGrpc.class) {
        if ((getAbortMethod = InferenceServiceGrpc.getAbortMethod) == null) {
          InferenceServiceGrpc.getAbortMethod = getAbortMethod =
              io.grpc.MethodDescriptor.<ai.sluice.v1.AbortRequest, ai.sluice.v1.AbortResponse>newBuilder()
              .setType(io.grpc.MethodDescriptor.MethodType.UNARY)
              .setFullMethodName(generateFullMethodName(SERVICE_NAME, "Abort"))
              .setSampledToLocalTracing(true)
              .setRequestMarshaller(io.grpc.protobuf.ProtoUtils.marshaller(
                  ai.sluice.v1.AbortRequest.getDefaultInstance()))
              .setResponseMarshaller(io.grpc.protobuf.ProtoUtils.marshaller(
                  ai.sluice.v1.AbortResponse.getDefaultInstance()))
              .setSchemaDescriptor(new InferenceServiceMethodDescriptorSupplier("Abort"))
              .build();
        }
      }
    }
    return getAbortMethod;
  }

  private static volatile io.grpc.MethodDescriptor<ai.sluice.v1.TokenizeRequest,
      ai.sluice.v1.TokenizeResponse> getTokenizeMethod;

  @io.grpc.stub.annotations.RpcMethod(
      fullMethodName = SERVICE_NAME + '/' + "Tokenize",
      requestType = ai.sluice.v1.TokenizeRequest.class,
      responseType = ai.sluice.v1.TokenizeResponse.class,
      methodType = io.grpc.MethodDescriptor.MethodType.UNARY)
  public static io.grpc.MethodDescriptor<ai.sluice.v1.TokenizeRequest,
      ai.sluice.v1.TokenizeResponse> getTokenizeMethod() {
    io.grpc.MethodDescriptor<ai.sluice.v1.TokenizeRequest, ai.sluice.v1.TokenizeResponse> getTokenizeMethod;
    if ((getTokenizeMethod = InferenceServiceGrpc.getTokenizeMethod) == null) {
      synchronized (InferenceServiceGrpc.class) {
        if ((getTokenizeMethod = InferenceServiceGrpc.getTokenizeMethod) == null) {
          InferenceServiceGrpc.getTokenizeMethod = getTokenizeMethod =
              io.grpc.MethodDescriptor.<ai.sluice.v1.TokenizeRequest, ai.sluice.v1.TokenizeResponse>newBuilder()
              .setType(io.grpc.MethodDescriptor.MethodType.UNARY)
              .setFullMethodName(generateFullMethodName(SERVICE_NAME, "Tokenize"))
              .setSampledToLocalTracing(true)
              .setRequestMarshaller(io.grpc.protobuf.ProtoUtils.marshaller(
                  ai.sluice.v1.TokenizeRequest.getDefaultInstance()))
              .setResponseMarshaller(io.grpc.protobuf.ProtoUtils.marshaller(
                  ai.sluice.v1.TokenizeResponse.getDefaultInstance()))
              .setSchemaDescriptor(new InferenceServiceMethodDescriptorSupplier("Tokenize"))
              .build();
        }
      }
    }
    return getTokenizeMethod;
  }

  private static volatile io.grpc.MethodDescriptor<ai.sluice.v1.GetModelInfoRequest,
      ai.sluice.v1.GetModelInfoResponse> getGetModelInfoMethod;

  @io.grpc.stub.annotations.RpcMethod(
      fullMethodName = SERVICE_NAME + '/' + "GetModelInfo",
      requestType = ai.sluice.v1.GetModelInfoRequest.class,
      responseType = ai.sluice.v1.GetModelInfoResponse.class,
      methodType = io.grpc.MethodDescriptor.MethodType.UNARY)
  public static io.grpc.MethodDescriptor<ai.sluice.v1.GetModelInfoRequest,
      ai.sluice.v1.GetModelInfoResponse> getGetModelInfoMethod() {
    io.grpc.MethodDescriptor<ai.sluice.v1.GetModelInfoRequest, ai.sluice.v1.GetModelInfoResponse> getGetModelInfoMethod;
    if ((getGetModelInfoMethod = InferenceServiceGrpc.getGetModelInfoMethod) == null) {
      synchronized (InferenceServiceGrpc.class) {
        if ((getGetModelInfoMethod = InferenceServiceGrpc.getGetModelInfoMethod) == null) {
          InferenceServiceGrpc.getGetModelInfoMethod = getGetModelInfoMethod =
              io.grpc.MethodDescriptor.<ai.sluice.v1.GetModelInfoRequest, ai.sluice.v1.GetModelInfoResponse>newBuilder()
              .setType(io.grpc.MethodDescriptor.MethodType.UNARY)
              .setFullMethodName(generateFullMethodName(SERVICE_NAME, "GetModelInfo"))
              .setSampledToLocalTracing(true)
              .setRequestMarshaller(io.grpc.protobuf.ProtoUtils.marshaller(
                  ai.sluice.v1.GetModelInfoRequest.getDefaultInstance()))
              .setResponseMarshaller(io.grpc.protobuf.ProtoUtils.marshaller(
                  ai.sluice.v1.GetModelInfoResponse.getDefaultInstance()))
              .setSchemaDescriptor(new InferenceServiceMethodDescriptorSupplier("GetModelInfo"))
              .build();
        }
      }
    }
    return getGetModelInfoMethod;
  }

  /**
   * Creates a new async stub that supports all call types for the service
   */
  public static InferenceServiceStub newStub(io.grpc.Channel channel) {
    io.grpc.stub.AbstractStub.StubFactory<InferenceServiceStub> factory =
      new io.grpc.stub.AbstractStub.StubFactory<InferenceServiceStub>() {
        @java.lang.Override
        public InferenceServiceStub newStub(io.grpc.Channel channel, io.grpc.CallOptions callOptions) {
          return new InferenceServiceStub(channel, callOptions);
        }
      };
    return InferenceServiceStub.newStub(factory, channel);
  }

  /**
   * Creates a new blocking-style stub that supports unary and streaming output calls on the service
   */
  public static InferenceServiceBlockingStub newBlockingStub(
      io.grpc.Channel channel) {
    io.grpc.stub.AbstractStub.StubFactory<InferenceServiceBlockingStub> factory =
      new io.grpc.stub.AbstractStub.StubFactory<InferenceServiceBlockingStub>() {
        @java.lang.Override
        public InferenceServiceBlockingStub newStub(io.grpc.Channel channel, io.grpc.CallOptions callOptions) {
          return new InferenceServiceBlockingStub(channel, callOptions);
        }
      };
    return InferenceServiceBlockingStub.newStub(factory, channel);
  }

  /**
   * Creates a new ListenableFuture-style stub that supports unary calls on the service
   */
  public static InferenceServiceFutureStub newFutureStub(
      io.grpc.Channel channel) {
    io.grpc.stub.AbstractStub.StubFactory<InferenceServiceFutureStub> factory =
      new io.grpc.stub.AbstractStub.StubFactory<InferenceServiceFutureStub>() {
        @java.lang.Override
        public InferenceServiceFutureStub newStub(io.grpc.Channel channel, io.grpc.CallOptions callOptions) {
          return new InferenceServiceFutureStub(channel, callOptions);
        }
      };
    return InferenceServiceFutureStub.newStub(factory, channel);
  }

  /**
   * <pre>
   * InferenceService generates text from one model held by the server.
   * </pre>
   */
  public static abstract class InferenceServiceImplBase implements io.grpc.BindableService {

    /**
     * <pre>
     * Generate streams the chunks of one request; the last chunk carries finish_reason, usage
     * and timings. Cancelling the call (or passing its deadline) aborts the request.
     * </pre>
     */
    public void generate(ai.sluice.v1.GenerateRequest request,
        io.grpc.stub.StreamObserver<ai.sluice.v1.GenerateResponse> responseObserver) {
      io.grpc.stub.ServerCalls.asyncUnimplementedUnaryCall(getGenerateMethod(), responseObserver);
    }

    /**
     * <pre>
     * StreamGenerate carries many concurrent requests on one stream, each named by a
     * client-chosen request_id. A request's error is reported in-band and does not end the
     * stream; half-closing finishes the outstanding requests, then ends the stream;
     * cancelling the call aborts every request on it.
     * </pre>
     */
    public io.grpc.stub.StreamObserver<ai.sluice.v1.StreamGenerateRequest> streamGenerate(
        io.grpc.stub.StreamObserver<ai.sluice.v1.StreamGenerateResponse> responseObserver) {
      return io.grpc.stub.ServerCalls.asyncUnimplementedStreamingCall(getStreamGenerateMethod(), responseObserver);
    }

    /**
     * <pre>
     * Abort stops a request started with Generate by the same tenant; its stream ends with
     * FINISH_REASON_ABORT. Idempotent: OK for a live request or one that ended lately. NOT_FOUND
     * for an id never seen (or another tenant's); such an Abort is still remembered for 30 s, and a
     * Generate with that id arriving meanwhile ends at once with FINISH_REASON_ABORT.
     * </pre>
     */
    public void abort(ai.sluice.v1.AbortRequest request,
        io.grpc.stub.StreamObserver<ai.sluice.v1.AbortResponse> responseObserver) {
      io.grpc.stub.ServerCalls.asyncUnimplementedUnaryCall(getAbortMethod(), responseObserver);
    }

    /**
     * <pre>
     * Tokenize returns the token ids the server would feed the model for a prompt.
     * </pre>
     */
    public void tokenize(ai.sluice.v1.TokenizeRequest request,
        io.grpc.stub.StreamObserver<ai.sluice.v1.TokenizeResponse> responseObserver) {
      io.grpc.stub.ServerCalls.asyncUnimplementedUnaryCall(getTokenizeMethod(), responseObserver);
    }

    /**
     * <pre>
     * GetModelInfo describes the served model and the KV cache.
     * </pre>
     */
    public void getModelInfo(ai.sluice.v1.GetModelInfoRequest request,
        io.grpc.stub.StreamObserver<ai.sluice.v1.GetModelInfoResponse> responseObserver) {
      io.grpc.stub.ServerCalls.asyncUnimplementedUnaryCall(getGetModelInfoMethod(), responseObserver);
    }

    @java.lang.Override public final io.grpc.ServerServiceDefinition bindService() {
      return io.grpc.ServerServiceDefinition.builder(getServiceDescriptor())
          .addMethod(
            getGenerateMethod(),
            io.grpc.stub.ServerCalls.asyncServerStreamingCall(
              new MethodHandlers<
                ai.sluice.v1.GenerateRequest,
                ai.sluice.v1.GenerateResponse>(
                  this, METHODID_GENERATE)))
          .addMethod(
            getStreamGenerateMethod(),
            io.grpc.stub.ServerCalls.asyncBidiStreamingCall(
              new MethodHandlers<
                ai.sluice.v1.StreamGenerateRequest,
                ai.sluice.v1.StreamGenerateResponse>(
                  this, METHODID_STREAM_GENERATE)))
          .addMethod(
            getAbortMethod(),
            io.grpc.stub.ServerCalls.asyncUnaryCall(
              new MethodHandlers<
                ai.sluice.v1.AbortRequest,
                ai.sluice.v1.AbortResponse>(
                  this, METHODID_ABORT)))
          .addMethod(
            getTokenizeMethod(),
            io.grpc.stub.ServerCalls.asyncUnaryCall(
              new MethodHandlers<
                ai.sluice.v1.TokenizeRequest,
                ai.sluice.v1.TokenizeResponse>(
                  this, METHODID_TOKENIZE)))
          .addMethod(
            getGetModelInfoMethod(),
            io.grpc.stub.ServerCalls.asyncUnaryCall(
              new MethodHandlers<
                ai.sluice.v1.GetModelInfoRequest,
                ai.sluice.v1.GetModelInfoResponse>(
                  this, METHODID_GET_MODEL_INFO)))
          .build();
    }
  }

  /**
   * <pre>
   * InferenceService generates text from one model held by the server.
   * </pre>
   */
  public static final class InferenceServiceStub extends io.grpc.stub.AbstractAsyncStub<InferenceServiceStub> {
    private InferenceServiceStub(
        io.grpc.Channel channel, io.grpc.CallOptions callOptions) {
      super(channel, callOptions);
    }

    @java.lang.Override
    protected InferenceServiceStub build(
        io.grpc.Channel channel, io.grpc.CallOptions callOptions) {
      return new InferenceServiceStub(channel, callOptions);
    }

    /**
     * <pre>
     * Generate streams the chunks of one request; the last chunk carries finish_reason, usage
     * and timings. Cancelling the call (or passing its deadline) aborts the request.
     * </pre>
     */
    public void generate(ai.sluice.v1.GenerateRequest request,
        io.grpc.stub.StreamObserver<ai.sluice.v1.GenerateResponse> responseObserver) {
      io.grpc.stub.ClientCalls.asyncServerStreamingCall(
          getChannel().newCall(getGenerateMethod(), getCallOptions()), request, responseObserver);
    }

    /**
     * <pre>
     * StreamGenerate carries many concurrent requests on one stream, each named by a
     * client-chosen request_id. A request's error is reported in-band and does not end the
     * stream; half-closing finishes the outstanding requests, then ends the stream;
     * cancelling the call aborts every request on it.
     * </pre>
     */
    public io.grpc.stub.StreamObserver<ai.sluice.v1.StreamGenerateRequest> streamGenerate(
        io.grpc.stub.StreamObserver<ai.sluice.v1.StreamGenerateResponse> responseObserver) {
      return io.grpc.stub.ClientCalls.asyncBidiStreamingCall(
          getChannel().newCall(getStreamGenerateMethod(), getCallOptions()), responseObserver);
    }

    /**
     * <pre>
     * Abort stops a request started with Generate by the same tenant; its stream ends with
     * FINISH_REASON_ABORT. Idempotent: OK for a live request or one that ended lately. NOT_FOUND
     * for an id never seen (or another tenant's); such an Abort is still remembered for 30 s, and a
     * Generate with that id arriving meanwhile ends at once with FINISH_REASON_ABORT.
     * </pre>
     */
    public void abort(ai.sluice.v1.AbortRequest request,
        io.grpc.stub.StreamObserver<ai.sluice.v1.AbortResponse> responseObserver) {
      io.grpc.stub.ClientCalls.asyncUnaryCall(
          getChannel().newCall(getAbortMethod(), getCallOptions()), request, responseObserver);
    }

    /**
     * <pre>
     * Tokenize returns the token ids the server would feed the model for a prompt.
     * </pre>
     */
    public void tokenize(ai.sluice.v1.TokenizeRequest request,
        io.grpc.stub.StreamObserver<ai.sluice.v1.TokenizeResponse> responseObserver) {
      io.grpc.stub.ClientCalls.asyncUnaryCall(
          getChannel().newCall(getTokenizeMethod(), getCallOptions()), request, responseObserver);
    }

    /**
     * <pre>
     * GetModelInfo describes the served model and the KV cache.
     * </pre>
     */
    public void getModelInfo(ai.sluice.v1.GetModelInfoRequest request,
        io.grpc.stub.StreamObserver<ai.sluice.v1.GetModelInfoResponse> responseObserver) {
      io.grpc.stub.ClientCalls.asyncUnaryCall(
          getChannel().newCall(getGetModelInfoMethod(), getCallOptions()), request, responseObserver);
    }
  }

  /**
   * <pre>
   * InferenceService generates text from one model held by the server.
   * </pre>
   */
  public static final class InferenceServiceBlockingStub extends io.grpc.stub.AbstractBlockingStub<InferenceServiceBlockingStub> {
    private InferenceServiceBlockingStub(
        io.grpc.Channel channel, io.grpc.CallOptions callOptions) {
      super(channel, callOptions);
    }

    @java.lang.Override
    protected InferenceServiceBlockingStub build(
        io.grpc.Channel channel, io.grpc.CallOptions callOptions) {
      return new InferenceServiceBlockingStub(channel, callOptions);
    }

    /**
     * <pre>
     * Generate streams the chunks of one request; the last chunk carries finish_reason, usage
     * and timings. Cancelling the call (or passing its deadline) aborts the request.
     * </pre>
     */
    public java.util.Iterator<ai.sluice.v1.GenerateResponse> generate(
        ai.sluice.v1.GenerateRequest request) {
      return io.grpc.stub.ClientCalls.blockingServerStreamingCall(
          getChannel(), getGenerateMethod(), getCallOptions(), request);
    }

    /**
     * <pre>
     * Abort stops a request started with Generate by the same tenant; its stream ends with
     * FINISH_REASON_ABORT. Idempotent: OK for a live request or one that ended lately. NOT_FOUND
     * for an id never seen (or another tenant's); such an Abort is still remembered for 30 s, and a
     * Generate with that id arriving meanwhile ends at once with FINISH_REASON_ABORT.
     * </pre>
     */
    public ai.sluice.v1.AbortResponse abort(ai.sluice.v1.AbortRequest request) {
      return io.grpc.stub.ClientCalls.blockingUnaryCall(
          getChannel(), getAbortMethod(), getCallOptions(), request);
    }

    /**
     * <pre>
     * Tokenize returns the token ids the server would feed the model for a prompt.
     * </pre>
     */
    public ai.sluice.v1.TokenizeResponse tokenize(ai.sluice.v1.TokenizeRequest request) {
      return io.grpc.stub.ClientCalls.blockingUnaryCall(
          getChannel(), getTokenizeMethod(), getCallOptions(), request);
    }

    /**
     * <pre>
     * GetModelInfo describes the served model and the KV cache.
     * </pre>
     */
    public ai.sluice.v1.GetModelInfoResponse getModelInfo(ai.sluice.v1.GetModelInfoRequest request) {
      return io.grpc.stub.ClientCalls.blockingUnaryCall(
          getChannel(), getGetModelInfoMethod(), getCallOptions(), request);
    }
  }

  /**
   * <pre>
   * InferenceService generates text from one model held by the server.
   * </pre>
   */
  public static final class InferenceServiceFutureStub extends io.grpc.stub.AbstractFutureStub<InferenceServiceFutureStub> {
    private InferenceServiceFutureStub(
        io.grpc.Channel channel, io.grpc.CallOptions callOptions) {
      super(channel, callOptions);
    }

    @java.lang.Override
    protected InferenceServiceFutureStub build(
        io.grpc.Channel channel, io.grpc.CallOptions callOptions) {
      return new InferenceServiceFutureStub(channel, callOptions);
    }

    /**
     * <pre>
     * Abort stops a request started with Generate by the same tenant; its stream ends with
     * FINISH_REASON_ABORT. Idempotent: OK for a live request or one that ended lately. NOT_FOUND
     * for an id never seen (or another tenant's); such an Abort is still remembered for 30 s, and a
     * Generate with that id arriving meanwhile ends at once with FINISH_REASON_ABORT.
     * </pre>
     */
    public com.google.common.util.concurrent.ListenableFuture<ai.sluice.v1.AbortResponse> abort(
        ai.sluice.v1.AbortRequest request) {
      return io.grpc.stub.ClientCalls.futureUnaryCall(
          getChannel().newCall(getAbortMethod(), getCallOptions()), request);
    }

    /**
     * <pre>
     * Tokenize returns the token ids the server would feed the model for a prompt.
     * </pre>
     */
    public com.google.common.util.concurrent.ListenableFuture<ai.sluice.v1.TokenizeResponse> tokenize(
        ai.sluice.v1.TokenizeRequest request) {
      return io.grpc.stub.ClientCalls.futureUnaryCall(
          getChannel().newCall(getTokenizeMethod(), getCallOptions()), request);
    }

    /**
     * <pre>
     * GetModelInfo describes the served model and the KV cache.
     * </pre>
     */
    public com.google.common.util.concurrent.ListenableFuture<ai.sluice.v1.GetModelInfoResponse> getModelInfo(
        ai.sluice.v1.GetModelInfoRequest request) {
      return io.grpc.stub.ClientCalls.futureUnaryCall(
          getChannel().newCall(getGetModelInfoMethod(), getCallOptions()), request);
    }
  }

  private static final int METHODID_GENERATE = 0;
  private static final int METHODID_ABORT = 1;
  private static final int METHODID_TOKENIZE = 2;
  private static final int METHODID_GET_MODEL_INFO = 3;
  private static final int METHODID_STREAM_GENERATE = 4;

  private static final class MethodHandlers<Req, Resp> implements
      io.grpc.stub.ServerCalls.UnaryMethod<Req, Resp>,
      io.grpc.stub.ServerCalls.ServerStreamingMethod<Req, Resp>,
      io.grpc.stub.ServerCalls.ClientStreamingMethod<Req, Resp>,
      io.grpc.stub.ServerCalls.BidiStreamingMethod<Req, Resp> {
    private final InferenceServiceImplBase serviceImpl;
    private final int methodId;

    MethodHandlers(InferenceServiceImplBase serviceImpl, int methodId) {
      this.serviceImpl = serviceImpl;
      this.methodId = methodId;
    }

    @java.lang.Override
    @java.lang.SuppressWarnings("unchecked")
    public void invoke(Req request, io.grpc.stub.StreamObserver<Resp> responseObserver) {
      switch (methodId) {
        case METHODID_GENERATE:
          serviceImpl.generate((ai.sluice.v1.GenerateRequest) request,
              (io.grpc.stub.StreamObserver<ai.sluice.v1.GenerateResponse>) responseObserver);
          break;
        case METHODID_ABORT:
          serviceImpl.abort((ai.sluice.v1.AbortRequest) request,
              (io.grpc.stub.StreamObserver<ai.sluice.v1.AbortResponse>) responseObserver);
          break;
        case METHODID_TOKENIZE:
          serviceImpl.tokenize((ai.sluice.v1.TokenizeRequest) request,
              (io.grpc.stub.StreamObserver<ai.sluice.v1.TokenizeResponse>) responseObserver);
          break;
        case METHODID_GET_MODEL_INFO:
          serviceImpl.getModelInfo((ai.sluice.v1.GetModelInfoRequest) request,
              (io.grpc.stub.StreamObserver<ai.sluice.v1.GetModelInfoResponse>) responseObserver);
          break;
        default:
          throw new AssertionError();
      }
    }

    @java.lang.Override
    @java.lang.SuppressWarnings("unchecked")
    public io.grpc.stub.StreamObserver<Req> invoke(
        io.grpc.stub.StreamObserver<Resp> responseObserver) {
      switch (methodId) {
        case METHODID_STREAM_GENERATE:
          return (io.grpc.stub.StreamObserver<Req>) serviceImpl.streamGenerate(
              (io.grpc.stub.StreamObserver<ai.sluice.v1.StreamGenerateResponse>) responseObserver);
        default:
          throw new AssertionError();
      }
    }
  }

  private static abstract class InferenceServiceBaseDescriptorSupplier
      implements io.grpc.protobuf.ProtoFileDescriptorSupplier, io.grpc.protobuf.ProtoServiceDescriptorSupplier {
    InferenceServiceBaseDescriptorSupplier() {}

    @java.lang.Override
    public com.google.protobuf.Descriptors.FileDescriptor getFileDescriptor() {
      return ai.sluice.v1.SluiceProto.getDescriptor();
    }

    @java.lang.Override
    public com.google.protobuf.Descriptors.ServiceDescriptor getServiceDescriptor() {
      return getFileDescriptor().findServiceByName("InferenceService");
    }
  }

  private static final class InferenceServiceFileDescriptorSupplier
      extends InferenceServiceBaseDescriptorSupplier {
    InferenceServiceFileDescriptorSupplier() {}
  }

  private static final class InferenceServiceMethodDescriptorSupplier
      extends InferenceServiceBaseDescriptorSupplier
      implements io.grpc.protobuf.ProtoMethodDescriptorSupplier {
    private final String methodName;

    InferenceServiceMethodDescriptorSupplier(String methodName) {
      this.methodName = methodName;
    }

    @java.lang.Override
    public com.google.protobuf.Descriptors.MethodDescriptor getMethodDescriptor() {
      return getServiceDescriptor().findMethodByName(methodName);
    }
  }

  private static volatile io.grpc.ServiceDescriptor serviceDescriptor;

  public static io.grpc.ServiceDescriptor getServiceDescriptor() {
    io.grpc.ServiceDescriptor result = serviceDescriptor;
    if (result == null) {
      synchronized (InferenceServiceGrpc.class) {
        result = serviceDescriptor;
        if (result == null) {
          serviceDescriptor = result = io.grpc.ServiceDescriptor.newBuilder(SERVICE_NAME)
              .setSchemaDescriptor(new InferenceServiceFileDescriptorSupplier())
              .addMethod(getGenerateMethod())
              .addMethod(getStreamGenerateMethod())
              .addMethod(getAbortMethod())
              .addMethod(getTokenizeMethod())
              .addMethod(getGetModelInfoMethod())
              .build();
        }
      }
    }
    return result;
  }
}
