"""Greedy decoding of a batch of sequences with llama.cpp (llama-cpp-python's low-level API), timed.

Runs in llama-cpp-python's own environment, so it imports nothing of Sluice and nothing but the standard
library, numpy and llama_cpp:

    /path/to/llamacpp-venv/bin/python llamacpp_runner.py MODEL.gguf PROMPTS.json --max-tokens 64 --threads 2

PROMPTS.json holds a list of token-id lists. All sequences share one context (one KV cache, `n_seq_max`
sequences) and advance together: one `llama_decode` call for every prompt token, then one per output
token covering every sequence. Prints one JSON line: {"seconds": ..., "output_tokens": ...}.
"""

from __future__ import annotations

import argparse
import json
import time

import llama_cpp as lc
import numpy as np


class BatchedContext:
    def __init__(self, model_path: str, num_seqs: int, max_len: int, threads: int) -> None:
        lc.llama_backend_init()
        self.model = lc.llama_model_load_from_file(model_path.encode(), lc.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {model_path}")
        params = lc.llama_context_default_params()
        params.n_ctx = num_seqs * max_len
        params.n_batch = num_seqs * max_len
        params.n_ubatch = min(512, num_seqs * max_len)
        params.n_seq_max = num_seqs
        params.n_threads = params.n_threads_batch = threads
        params.kv_unified = True
        self.ctx = lc.llama_init_from_model(self.model, params)
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.batch = lc.llama_batch_init(num_seqs * max_len, 0, num_seqs)

    def decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """entries: (token, position, sequence, wants logits)."""
        batch = self.batch
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, logits
        batch.n_tokens = len(entries)
        if lc.llama_decode(self.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def argmax(self, index: int) -> int:
        logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(self.ctx, index), shape=(self.n_vocab,))
        return int(logits.argmax())

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Greedy: max_tokens new tokens per prompt (no stop on EOS, as the other engines here)."""
        lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
        entries = [
            (token, pos, seq, pos == len(prompt) - 1)
            for seq, prompt in enumerate(prompts)
            for pos, token in enumerate(prompt)
        ]
        self.decode(entries)
        last = [i for i, entry in enumerate(entries) if entry[3]]
        outputs: list[list[int]] = [[] for _ in prompts]
        for step in range(max_tokens):
            for seq, index in enumerate(last):
                outputs[seq].append(self.argmax(index))
            if step + 1 == max_tokens:
                break
            self.decode([(out[-1], len(prompts[seq]) + step, seq, True) for seq, out in enumerate(outputs)])
            last = list(range(len(prompts)))
        return outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("prompts")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    with open(args.prompts) as f:
        prompts = json.load(f)
    max_len = max(len(p) for p in prompts) + args.max_tokens
    context = BatchedContext(args.model, len(prompts), max_len, args.threads)
    context.generate([p[:8] for p in prompts], 4)  # warm-up
    start = time.perf_counter()
    outputs = context.generate(prompts, args.max_tokens)
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "output_tokens": sum(len(o) for o in outputs), "outputs": outputs}))


if __name__ == "__main__":
    main()
