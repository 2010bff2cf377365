"""`sluice generate`: stream one completion from a running server to the terminal."""

from __future__ import annotations

import argparse
import os
import sys
import time

from sluice.client import MAX_TIMEOUT_S, Client, SluiceError, generate_request
from sluice.tls_flags import add_tls_flags, tls_client_options
from sluice.v1 import sluice_pb2 as pb


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the user message (with --raw: the prompt text)")
    parser.add_argument("--target", default="localhost:50051", help="HOST:PORT of the server")
    parser.add_argument(
        "--raw", action="store_true", help="send the prompt as plain text, without the chat template"
    )
    parser.add_argument("--system", default=None, help="a system message before the user message")
    parser.add_argument(
        "--max-tokens",
        type=_bounded(int, 1, 2**31 - 1),
        default=128,
        help="the most tokens to generate (default: 128)",
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (the default)")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=_bounded(int, -(2**63), 2**63 - 1), default=None)
    parser.add_argument("--api-key", default=os.environ.get("SLUICE_API_KEY"), help="or SLUICE_API_KEY")
    parser.add_argument(
        # grpc ends a call at once whose deadline it cannot hold (from ~1e10 s, and inf)
        "--timeout",
        type=_bounded(float, 0.001, MAX_TIMEOUT_S),
        default=None,
        help="call deadline in seconds",
    )
    add_tls_flags(parser)


def _bounded(kind: type, low: float, high: float):
    """An argparse type: `kind(text)` in [low, high] (what the request's field holds), else an error
    that argparse reports naming the flag."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in [{low}, {high}], got {text}")
        return value

    return parse


def _request(args: argparse.Namespace):
    sampling = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "seed": args.seed,
    }
    if args.raw:
        return generate_request(args.prompt, **sampling)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": args.prompt})
    return generate_request(messages=messages, **sampling)


def run(args: argparse.Namespace) -> int:
    """Streams the answer to stdout, the reasoning and the stats line to stderr; the exit status."""
    try:
        return _generate(args)
    except BrokenPipeError:  # the reader went away (`| head`): the call is cancelled, no traceback
        # Python's recipe: stdout onto /dev/null, so that the interpreter's own flush at exit cannot fail too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:  # Ctrl-C: the call is cancelled, as a shell expects, no traceback
        print(file=sys.stderr)
        return 130


def _generate(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    first_token: float | None = None
    first_chunk_tokens = 0
    num_tokens = 0
    # The last character written, to the answer (stdout) or the reasoning (stderr); none yet: no newline owed
    last_written, last_stream = "\n", sys.stdout
    finish_reason = pb.FINISH_REASON_UNSPECIFIED
    try:  # a key, prompt or TLS file grpc cannot use (SLUICE_API_KEY="", text not UTF-8): no traceback
        request = _request(args)
        client = Client(args.target, api_key=args.api_key, **tls_client_options(args))
    except ValueError as exc:
        print(f"sluice generate: {exc}", file=sys.stderr)
        return 2
    try:
        with client:
            for chunk in client.generate(request, timeout=args.timeout):
                if chunk.token_ids and first_token is None:
                    first_token = time.perf_counter()
                    first_chunk_tokens = len(chunk.token_ids)  # more than 1 with --stream-interval
                num_tokens += len(chunk.token_ids)
                # A thinking model's reasoning (a server with --reasoning-parser) goes to stderr, so that
                # stdout holds the answer alone; the answer starts on a line of its own.
                for stream, text in ((sys.stderr, chunk.reasoning_text), (sys.stdout, chunk.text)):
                    if not text:
                        continue
                    if stream is not last_stream and last_written != "\n":
                        last_stream.write("\n")
                        last_stream.flush()
                    stream.write(text)
                    stream.flush()
                    last_written, last_stream = text[-1], stream
                finish_reason = chunk.finish_reason or finish_reason
    except SluiceError as exc:
        print(f"\nsluice generate: {exc}", file=sys.stderr)
        return 1
    if finish_reason in (pb.FINISH_REASON_ABORT, pb.FINISH_REASON_ERROR):
        # The server ended the request (drained past its grace period, or failed it): the text is cut.
        name = pb.FinishReason.Name(finish_reason).removeprefix("FINISH_REASON_").lower()
        print(f"\nsluice generate: the request ended with finish reason {name}", file=sys.stderr)
        return 1
    elapsed = time.perf_counter() - start
    if last_written != "\n":  # the stats line starts on a line of its own
        last_stream.write("\n")
        last_stream.flush()
    ttft = None if first_token is None else first_token - start
    print(stats_line(elapsed, ttft, num_tokens, first_chunk_tokens), file=sys.stderr)
    return 0


def stats_line(elapsed: float, ttft: float | None, num_tokens: int, first_chunk_tokens: int) -> str:
    """`N tokens in Ts: R tokens/s, TTFT M ms`; the rate is that of the tokens after the first chunk
    (which holds several with --stream-interval) over the time after it."""
    later_tokens = num_tokens - first_chunk_tokens
    decode_seconds = elapsed - (ttft or 0.0)
    rate = later_tokens / decode_seconds if later_tokens > 0 and decode_seconds > 0 else float("nan")
    ttft_ms = float("nan") if ttft is None else ttft * 1000
    return f"{num_tokens} tokens in {elapsed:.2f}s: {rate:.1f} tokens/s, TTFT {ttft_ms:.0f} ms"
