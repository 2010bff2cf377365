"""F.linear (weight [out, in]) against a matmul with weights laid out once as W_t [in, out], contiguous,
on the embedded SmolLM2-135M's projection shapes, for the row counts a CPU decode step sees.

    python -m sluice.benchmarks.kernels.cpu_linear --rows 1 4 16 32 64 --repeats 5

Prints the min-max time per call over the repeats and the ratio of medians (F.linear / x @ W_t), and
checks both give the same values. A 2-core machine shared with others is noisy: read ranges, not points.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

# name: (in_features, out_features) for SmolLM2-135M (hidden 576, 9 + 2 * 3 heads of 64, MLP 1536).
SHAPES = {
    "qkv_proj": (576, 960),
    "o_proj": (576, 576),
    "gate_up_proj": (576, 3072),
    "down_proj": (1536, 576),
    "lm_head": (576, 49152),
}


def time_call(fn, min_seconds: float = 0.05) -> float:
    """Seconds per call, averaged over enough calls to last `min_seconds`."""
    fn()
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_seconds:
        fn()
        calls += 1
    return elapsed / calls


def compare(x, weight, weight_t, repeats: int) -> tuple[list[float], list[float]]:
    """Sorted seconds per call of F.linear(x, weight) and of x @ weight_t, `repeats` each, interleaved."""
    linear, matmul = [], []
    for _ in range(repeats):
        linear.append(time_call(lambda: F.linear(x, weight)))
        matmul.append(time_call(lambda: x @ weight_t))
    return sorted(linear), sorted(matmul)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m sluice.benchmarks.kernels.cpu_linear", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 4, 16, 32, 64])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, intra-op threads {torch.get_num_threads()}")
    print(f"{'shape':<14}{'rows':>5}{'F.linear us':>18}{'x @ W_t us':>18}{'ratio':>8}")
    torch.manual_seed(0)
    with torch.inference_mode():
        for name, (n_in, n_out) in SHAPES.items():
            weight = torch.randn(n_out, n_in) / n_in**0.5
            weight_t = weight.t().contiguous()  # [in, out], laid out once at load
            for rows in args.rows:
                x = torch.randn(rows, n_in)
                torch.testing.assert_close(F.linear(x, weight), x @ weight_t, rtol=1e-4, atol=1e-4)
                linear, matmul = compare(x, weight, weight_t, args.repeats)
                ratio = linear[len(linear) // 2] / matmul[len(matmul) // 2]
                print(
                    f"{name:<14}{rows:>5}{f'{linear[0] * 1e6:.0f}-{linear[-1] * 1e6:.0f}':>18}"
                    f"{f'{matmul[0] * 1e6:.0f}-{matmul[-1] * 1e6:.0f}':>18}{ratio:>7.2f}x"
                )


if __name__ == "__main__":
    main()
