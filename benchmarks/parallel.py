"""Data and pipeline parallel serving: output throughput of `--data-parallel-size 2` (two
engine ranks, one CPU each under the default binding) and of `--pipeline-parallel-size 2`
(two stage processes of 15 layers each, one CPU each; `pp2-20-10` splits the layers 20/10
with VLLM_PP_LAYER_PARTITION, as the last stage also runs the LM head and sampling) against
one engine process using both CPUs, on the bundled SmolLM2-135M, 16 and 64 requests at once.
Prints JSON.

    python benchmarks/parallel.py [--configs one,dp2,pp2,pp2-20-10] [--concurrency 16,64]
                                  [--rounds 3] [--max-tokens 128] [--output F]

One `sous serve` per configuration (the same flags otherwise), greedy chat requests on short
seeded topics. Per configuration and concurrency level, `--rounds` rounds of fresh prompts
after one warm-up round; each round's output tok/s is completion tokens over wall time.
Reported: the median over rounds and its ratio against `one` measured by the same script on
the same machine. Greedy answers are compared with `one`: `identical` is false if any
differed (it must not; the exit status is then 1).
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE / "peers")]
from peer_engines import wait_idle  # noqa: E402

from chat_rounds import add_round_args, measure, one_round, report  # noqa: E402
from kv_offload import machine, median  # noqa: E402

CONFIGS: dict[str, list[str]] = {
    "one": [],
    "dp2": ["--data-parallel-size", "2"],
    "pp2": ["--pipeline-parallel-size", "2"],
    "pp2-20-10": ["VLLM_PP_LAYER_PARTITION=20,10", "--pipeline-parallel-size", "2"],
}
TOPICS = ["a refrigerator", "the tides", "a compass", "yeast", "an elevator", "rainbows",
          "a thermostat", "bamboo", "a lighthouse", "snowflakes", "a microwave oven",
          "hummingbirds", "a submarine", "soap", "a windmill", "fireflies", "glass", "a kite"]
TASKS = ["How does {t} work?", "Tell me about {t}.", "Why is {t} useful?",
         "Describe {t} in simple words.", "Write a short story about {t}."]


def prompt(rng: random.Random) -> str:
    return rng.choice(TASKS).format(t=rng.choice(TOPICS)) + f" (note {rng.randrange(10**6)})"


def run_config(base: str, args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for conc in args.concurrency:
        rng = random.Random(f"parallel-{conc}")
        rounds = [[prompt(rng) for _ in range(conc)] for _ in range(args.rounds + 1)]
        one_round(base, rounds[0], conc, args.max_tokens)  # warm-up
        rates, answers = [], []
        for prompts in rounds[1:]:
            wait_idle(args.idle_wait)
            rate, texts, _ = one_round(base, prompts, conc, args.max_tokens)
            rates.append(rate)
            answers += texts
        results[str(conc)] = {"output_tok_per_s": median(rates), "rounds": rates,
                              "answers": answers}
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"comma list of {','.join(CONFIGS)}; one is always measured")
    add_round_args(p, [16, 64], 128)
    args = p.parse_args(argv)
    names = ["one"] + [c for c in args.configs.split(",") if c != "one"]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        p.error(f"unknown config(s) {unknown}; known: {', '.join(CONFIGS)}")
    configs = {c: CONFIGS[c] for c in names}
    measured = measure(configs, "one", args.timeout, lambda base: run_config(base, args))
    return report({"machine": machine(), "max_tokens": args.max_tokens, "rounds": args.rounds,
                   "configs": configs, "results": measured}, args.output)


if __name__ == "__main__":
    sys.exit(main())
