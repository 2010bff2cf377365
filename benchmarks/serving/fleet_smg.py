"""Multi-turn conversations through the SMG gateway to two Sluice workers: cache-aware against round-robin
routing, same run, same workload.

    python -m sluice.benchmarks.serving.fleet_smg [--conversations 32] [--turns 10] [--json out.json]

For each policy a fresh fleet starts (two `sluice serve` workers with empty prefix caches serving the
model `sluice serve` serves by default, the embedded SmolLM2-135M unless --model, and `smg launch
--policy P` in front of them, all on loopback), then `--concurrency` clients each hold conversations of
`--turns` turns through the OpenAI API (/v1/chat/completions, streamed, greedy): every turn sends the
whole history plus a new seeded user message. Per policy it prints the prompt tokens the workers
computed (prompt tokens minus those served from their prefix caches, from each response's usage), the
share of prompt tokens cached, TTFT p50/p90 as the client sees it (first content chunk), the wall
time and the requests each worker served. Cache-aware routing sends a conversation's turns to the
worker holding its prefix; round robin spreads them, so each worker recomputes histories it has not seen.
`cache_aware_events` is cache_aware told by the workers' KV events (`sluice serve --kv-events`) what
their caches hold, evictions included, instead of guessing from the requests it routed.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import openai
from prometheus_client.parser import text_string_to_metric_families

from sluice.bench.metrics import percentile
from sluice.benchmarks.serving.server_process import ServerProcess

# cache_aware_events: SMG's cache_aware fed by the workers' KV events (`sluice serve --kv-events`) instead
# of its own prefix tree of the requests it routed.
POLICIES = ("cache_aware", "cache_aware_events", "round_robin")
WORDS = (  # noqa: SIM905
    "river stone lantern orbit meadow copper signal harbor violet engine summit canvas thread ember "
    "glacier pocket mirror forest rocket velvet anchor puzzle crystal thunder garden compass"
).split()


@dataclass(frozen=True)
class Turn:
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float


@dataclass(frozen=True)
class PolicyResult:
    policy: str
    num_requests: int
    prompt_tokens: int
    prompt_tokens_computed: int
    ttft_p50_ms: float
    ttft_p90_ms: float
    seconds: float
    requests_per_worker: tuple[int, ...]

    @property
    def cached_share(self) -> float:
        return 1 - self.prompt_tokens_computed / max(self.prompt_tokens, 1)

    @classmethod
    def of(
        cls, policy: str, turns: list[Turn], seconds: float, requests_per_worker: tuple[int, ...]
    ) -> PolicyResult:
        """The policy's figures from its turns. A turn that streamed no content has no TTFT (NaN): left
        out of the percentiles, which interpolate as `sluice bench` reports its own (numpy's default)."""
        ttfts = [t.ttft_s for t in turns if not math.isnan(t.ttft_s)]
        return cls(
            policy=policy,
            num_requests=len(turns),
            prompt_tokens=sum(t.prompt_tokens for t in turns),
            prompt_tokens_computed=sum(t.prompt_tokens - t.cached_tokens for t in turns),
            ttft_p50_ms=1000 * percentile(ttfts, 50) if ttfts else math.nan,
            ttft_p90_ms=1000 * percentile(ttfts, 90) if ttfts else math.nan,
            seconds=seconds,
            requests_per_worker=requests_per_worker,
        )


class Gateway:
    """`smg launch` on a free loopback port in front of `worker_urls`; ready once it lists them healthy."""

    def __init__(self, worker_urls: list[str], policy: str, log: Path, timeout: float = 300.0) -> None:
        self.port, metrics_port = _free_port(), _free_port()
        command = [str(Path(sys.executable).parent / "smg"), "launch", "--host", "127.0.0.1"]
        command += ["--port", str(self.port), "--worker-urls", *worker_urls, "--policy", policy]
        command += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]
        command += ["--health-check-interval-secs", "5", "--log-level", "warn"]
        self._log = log.open("w")
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not self._ready(len(worker_urls)):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"smg did not get ready; see {log}")
            time.sleep(0.2)

    def _ready(self, num_workers: int) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/workers", timeout=5) as response:
                workers = json.loads(response.read())["workers"]
        except (OSError, ValueError, KeyError):
            return False
        return len(workers) == num_workers and all(w.get("is_healthy") for w in workers)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(60)
        self._log.close()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _user_message(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)) + "?"


def converse(client: openai.OpenAI, model: str, index: int, args: argparse.Namespace) -> list[Turn]:
    """One conversation, turn after turn; the seed makes its messages the same under every policy."""
    rng = random.Random(1000 + index)
    messages = [{"role": "system", "content": f"You are assistant {index}. " + _user_message(rng, 20)}]
    turns = []
    for _ in range(args.turns):
        messages.append({"role": "user", "content": _user_message(rng, args.user_words)})
        start = time.perf_counter()
        stream = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=args.max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        ttft, parts, usage = None, [], None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                ttft = ttft if ttft is not None else time.perf_counter() - start
                parts.append(chunk.choices[0].delta.content)
            usage = chunk.usage or usage
        messages.append({"role": "assistant", "content": "".join(parts)})
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        turns.append(Turn(usage.prompt_tokens, cached or 0, ttft if ttft is not None else float("nan")))
    return turns


def run_policy(policy: str, args: argparse.Namespace, logs: Path) -> PolicyResult:
    serve_args = ["--model", args.model] if args.model else []
    serve_args += ["--kv-cache-memory", args.kv_cache_memory, "--metrics-port", "0"]
    if policy == "cache_aware_events":
        serve_args.append("--kv-events")
    workers = []
    try:
        for i in range(2):
            log = (logs / f"{policy}-worker{i}.log").open("w")
            workers.append(ServerProcess(serve_args, stderr=log))
        smg_policy = policy.removesuffix("_events")
        gateway = Gateway([f"grpc://{w.target}" for w in workers], smg_policy, logs / f"{policy}-smg.log")
        try:
            client = openai.OpenAI(
                base_url=f"http://127.0.0.1:{gateway.port}/v1", api_key="unused", timeout=600, max_retries=0
            )
            model = client.models.list().data[0].id
            _wait_for_tokenizer(client, model)
            served_before = [_generate_calls(w) for w in workers]
            start = time.perf_counter()
            with ThreadPoolExecutor(args.concurrency) as pool:
                conversations = list(
                    pool.map(lambda i: converse(client, model, i, args), range(args.conversations))
                )
            seconds = time.perf_counter() - start
            requests_per_worker = tuple(
                _generate_calls(w) - before for w, before in zip(workers, served_before, strict=True)
            )
        finally:
            gateway.close()
    finally:
        for worker in workers:
            worker.stop()
    turns = [turn for conversation in conversations for turn in conversation]
    return PolicyResult.of(policy, turns, seconds, requests_per_worker)


def _wait_for_tokenizer(client: openai.OpenAI, model: str, timeout: float = 300.0) -> None:
    """SMG lists a model (and its workers healthy) before it has fetched the model's tokenizer, and
    answers 503 "not registered yet" until then: one short chat, retried until it is answered. Its prompt
    shares less than a KV block with the conversations' (their own system message), so no cached
    token comes of it; the requests each worker served are counted after it."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "ping"}], max_tokens=1, temperature=0
            )
            return
        except openai.InternalServerError as error:
            if error.status_code != 503 or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _generate_calls(worker: ServerProcess) -> int:
    """VllmEngine.Generate calls the worker served, from its /metrics."""
    url = f"http://127.0.0.1:{worker.ready_fields['metrics_port']}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return int(
        sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "sluice_rpc_requests_total"
            and sample.labels == {"method": "VllmEngine.Generate", "code": "OK"}
        )
    )


def print_table(results: list[PolicyResult]) -> None:
    print(
        f"{'policy':<18} {'requests':>8} {'prompt tok':>10} {'computed':>9} {'cached':>7} "
        f"{'TTFT p50':>9} {'TTFT p90':>9} {'wall':>7}  per worker"
    )
    for r in results:
        print(
            f"{r.policy:<18} {r.num_requests:>8} {r.prompt_tokens:>10} {r.prompt_tokens_computed:>9} "
            f"{r.cached_share:>6.0%} {r.ttft_p50_ms:>7.0f}ms {r.ttft_p90_ms:>7.0f}ms {r.seconds:>6.1f}s"
            f"  {'/'.join(map(str, r.requests_per_worker))}"
        )
    base = results[0]
    for other in results[1:] if base.prompt_tokens_computed else ():
        ratio = other.prompt_tokens_computed / base.prompt_tokens_computed
        print(f"{other.policy} computes {ratio:.2f}x the prompt tokens of {base.policy}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="what `sluice serve --model` takes (default: its own)")
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--user-words", type=int, default=24, help="words in each user message")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens of each answer")
    parser.add_argument("--concurrency", type=int, default=8, help="conversations in flight at once")
    parser.add_argument("--kv-cache-memory", default="256MiB", help="each worker's KV cache (CPU)")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fleet-smg-") as logs:
        results = [run_policy(policy, args, Path(logs)) for policy in args.policies]
    print(
        f"{args.conversations} conversations x {args.turns} turns, {args.concurrency} at once, "
        f"{args.max_tokens}-token answers, 2 workers"
    )
    print_table(results)
    if args.json:
        payload = {
            "args": vars(args),
            "results": [asdict(r) | {"cached_share": r.cached_share} for r in results],
        }
        Path(args.json).write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
