"""Speculative decoding: output throughput with n-gram, suffix and EAGLE-3 drafts against no
drafts, on the bundled SmolLM2-135M, one stream and 16 at once. Prints JSON.

    python benchmarks/spec_decode.py [--methods off,ngram,suffix,eagle3] [--concurrency 1,16]
                                     [--eagle3-head DIR] [--draft-confidence-threshold T]
                                     [--workloads edit,code,essay,chat]
                                     [--num-speculative-tokens 3] [--disable-by-batch-size N]
                                     [--rounds 3] [--max-tokens 160] [--output F]

`eagle3` needs `--eagle3-head`, a head `sous draft train --out DIR` wrote; `eagle3-threshold`
is the same head with `draft_confidence_threshold` T (`--draft-confidence-threshold`, default
0.6: a request drafts only tokens the head gives at least that probability). One `sous serve` per
method (the same flags otherwise), greedy chat requests, four workloads:

- `edit`: "rewrite this text, changing one word": a copy/edit workload, the case n-gram and
  suffix drafting are for (document and code edits, RAG, agents re-reading files); the
  answer repeats the prompt's eight sentences. Prose, because the bundled 135M model does
  not copy code: asked to repeat a module with one change, it writes different code;
- `code`: "rewrite this Python module with type hints": a code edit that the bundled model
  answers with code of its own, repeating only parts of the prompt;
- `essay`: the `sous bench serve` essay prompt: open-ended text with little to copy, where
  drafts are mostly rejected and their cost shows;
- `chat`: short assistant questions on topics `sous draft train`'s corpus does not hold (what
  a trained EAGLE-3 head is for).

Per method, workload and concurrency level, `--rounds` rounds of fresh prompts (one warm-up
round first), streamed; each round's output tok/s is completion tokens over wall time, and
each answer's decode tok/s its tokens after the first over the time from the first to the
last (what drafting speeds up; prefill is the same with and without). Reported: the median
over rounds (`output_tok_per_s`) and over answers (`decode_tok_per_s`), their ratios against
`off` measured by the same script on the same machine,
the mean acceptance length (1 + accepted/drafts, from the server's
`vllm:spec_decode_*` counters) and the draft acceptance rate. Greedy answers are compared
with `off` too: `identical` is false if any differed (it must not).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE / "peers")]
from peer_engines import wait_idle  # noqa: E402

from chat_rounds import add_round_args, measure, one_round, report  # noqa: E402
from kv_offload import machine, median  # noqa: E402

METHODS = {
    "off": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
              "prompt_lookup_max": 4},
    "suffix": {"method": "suffix", "num_speculative_tokens": 3},
}
WORDS = ["alpha", "beta", "gamma", "delta", "table", "count", "total", "value", "index",
         "record", "item", "price", "name", "user", "order", "score", "level", "limit", "offset"]


def code_prompt(rng: random.Random) -> str:
    """A small module of seeded functions to rewrite: most of the answer is in the prompt."""
    funcs = []
    for _ in range(3):
        name, a, b = rng.sample(WORDS, 3)
        funcs.append(f"def get_{name}({a}, {b}):\n    result = []\n"
                     f"    for x in {a}:\n        if x > {b}:\n            result.append(x)\n"
                     f"    return result\n")
    return ("Rewrite this Python code with type hints. Keep everything else the same.\n\n"
            "```python\n" + "\n".join(funcs) + "```")


SENTENCES = [
    "The river flows through the valley and past the old mill.",
    "In spring the water rises and the farmers open the gates to let it into the fields.",
    "In summer the children swim near the bridge.",
    "In autumn the leaves drift down the river to the sea.",
    "The baker on the corner opens his shop before the sun comes up.",
    "His bread is still warm when the first customers arrive.",
    "The library in the town square holds more than ten thousand books.",
    "On rainy afternoons it is full of students and old men reading newspapers.",
    "A small train stops at the station twice a day.",
    "Most of its passengers are going to the market in the next town.",
    "The market sells fish, cheese, fruit and flowers from the nearby farms.",
    "At night the streets are quiet and the only sound is the wind in the trees.",
    "The school at the top of the hill was built more than a hundred years ago.",
    "Its bell can be heard across the whole valley.",
    "Every winter the lake freezes and people skate on it until March.",
    "The mayor lives in a white house with a red door and a garden full of roses.",
]
SWAPS = [("river", "stream"), ("bread", "cake"), ("library", "museum"), ("train", "bus"),
         ("market", "fair"), ("school", "church"), ("lake", "pond"), ("valley", "canyon")]


def edit_prompt(rng: random.Random) -> str:
    """Eight seeded sentences (~150 tokens) to rewrite with one word changed."""
    text = " ".join(rng.sample(SENTENCES, 8))
    old, new = rng.choice([s for s in SWAPS if s[0] in text])
    return f"Rewrite this text, changing '{old}' to '{new}':\n\n{text}"


def essay_prompt(rng: random.Random) -> str:
    topic = " ".join(rng.sample(WORDS, 2))
    words = ", ".join(rng.sample(WORDS, 12))
    return (f"Write a long essay about {topic}. Cover each of these words in turn: {words}.")


CHAT_TOPICS = ["a refrigerator", "the tides", "a compass", "yeast", "an elevator", "rainbows",
               "a thermostat", "bamboo", "a lighthouse", "snowflakes", "a microwave oven",
               "hummingbirds", "a submarine", "soap", "a windmill", "fireflies"]
CHAT_TASKS = ["How does {t} work?", "Tell me about {t}.", "Why is {t} useful?",
              "Describe {t} in simple words."]


def chat_prompt(rng: random.Random) -> str:
    return rng.choice(CHAT_TASKS).format(t=rng.choice(CHAT_TOPICS))


WORKLOADS = {"edit": edit_prompt, "code": code_prompt, "essay": essay_prompt, "chat": chat_prompt}


def counters(base: str) -> dict[str, float]:
    text = httpx.get(base + "/metrics", timeout=10.0).text
    out = {}
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        m = re.search(rf"^vllm:spec_decode_{name}_total(?:{{[^}}]*}})? (\S+)$", text, re.M)
        out[name] = float(m.group(1)) if m else 0.0
    return out


def run_method(base: str, args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for workload in args.workloads:
        make = WORKLOADS[workload]
        for conc in args.concurrency:
            rng = random.Random(f"{workload}-{conc}")
            n = max(conc, 4)
            rounds = [[make(rng) for _ in range(n)] for _ in range(args.rounds + 1)]
            one_round(base, rounds[0], conc, args.max_tokens)  # warm-up
            before = counters(base)
            rates, answers, decode = [], [], []
            for prompts in rounds[1:]:
                wait_idle(args.idle_wait)
                rate, texts, decode_rates = one_round(base, prompts, conc, args.max_tokens)
                rates.append(rate)
                answers += texts
                decode += decode_rates
            after = counters(base)
            drafts = after["num_drafts"] - before["num_drafts"]
            proposed = after["num_draft_tokens"] - before["num_draft_tokens"]
            accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
            results[f"{workload}/{conc}"] = {
                "output_tok_per_s": median(rates), "rounds": rates, "answers": answers,
                "decode_tok_per_s": median(decode),
                "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
                "draft_acceptance_rate": accepted / proposed if proposed else None}
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--methods", default="off,ngram,suffix",
                   help=f"comma list of {','.join(METHODS)},eagle3,eagle3-threshold; off is "
                        "always measured")
    p.add_argument("--eagle3-head", type=Path,
                   help="EAGLE-3 head folder (methods eagle3, eagle3-threshold)")
    p.add_argument("--draft-confidence-threshold", type=float, default=0.6,
                   help="draft_confidence_threshold of method eagle3-threshold")
    p.add_argument("--workloads", type=lambda s: s.split(","), default=list(WORKLOADS),
                   help=f"comma list of {','.join(WORKLOADS)}")
    p.add_argument("--num-speculative-tokens", type=int, default=3,
                   help="k of the ngram and suffix methods")
    p.add_argument("--disable-by-batch-size", type=int, default=None,
                   help="the methods' disable_by_batch_size (default: always draft)")
    add_round_args(p, [1, 16], 160)
    args = p.parse_args(argv)
    for method in ("ngram", "suffix"):
        METHODS[method]["num_speculative_tokens"] = args.num_speculative_tokens
    methods = ["off"] + [m for m in args.methods.split(",") if m != "off"]
    if args.eagle3_head is not None:
        METHODS["eagle3"] = {"method": "eagle3", "model": str(args.eagle3_head.resolve()),
                             "num_speculative_tokens": 3}
        METHODS["eagle3-threshold"] = {
            **METHODS["eagle3"], "draft_confidence_threshold": args.draft_confidence_threshold}
    elif {"eagle3", "eagle3-threshold"} & set(methods):
        p.error("methods eagle3 and eagle3-threshold need --eagle3-head DIR (from `sous draft "
                "train --out DIR`)")
    if args.disable_by_batch_size is not None:
        for config in METHODS.values():
            if config is not None:
                config["disable_by_batch_size"] = args.disable_by_batch_size
    if any(w not in WORKLOADS for w in args.workloads):
        p.error(f"--workloads: known ones are {', '.join(WORKLOADS)}")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        p.error(f"unknown method(s) {unknown}; known: {', '.join(METHODS)}")
    configs = {m: ([] if METHODS[m] is None else
                   ["--speculative-config", json.dumps(METHODS[m])]) for m in methods}
    measured = measure(configs, "off", args.timeout, lambda base: run_method(base, args))
    return report({"machine": machine(), "max_tokens": args.max_tokens, "rounds": args.rounds,
                   "configs": {m: METHODS[m] for m in methods}, "results": measured},
                  args.output)

if __name__ == "__main__":
    sys.exit(main())
