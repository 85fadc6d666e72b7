"""`sous draft train`: distil an EAGLE-3 draft head for a model on this machine.

1. The engine serves MODEL in-process and answers a prompt corpus greedily; the model's aux
   hidden states over each prompt + answer are captured (`sous.draft.data`).
2. The draft vocabulary is the answers' most frequent tokens; the head's `lm_head` starts from
   the model's own output rows for them, everything else from a random init.
3. The head is trained with EAGLE-3's training-time test (`Eagle3Head.forward_ttt`): step j
   of the unrolled head predicts the token j + 2 ahead, loss weight 0.8^j, on answer tokens.
4. `--out DIR` gets `config.json` + `model.safetensors` (what `--speculative-config
   '{"method": "eagle3", "model": DIR}'` serves) every `--save-every` steps and at the end;
   `DIR/.train/` keeps the captured data and the optimizer state, so running the same command
   again resumes where it stopped (or stops at once when `--max-steps` is reached).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from sous.draft.data import Sample, capture_aux, dense_lm_head, draft_vocabulary, generate, prompts
from sous.draft.eagle3_head import Eagle3Head, HeadConfig

logger = logging.getLogger("sous.draft")
_DATA_KEYS = ("model", "num_prompts", "max_tokens", "prompts", "draft_vocab_size")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="sous draft train",
        description="Distil an EAGLE-3 draft head for MODEL from its own greedy answers.")
    p.add_argument("--model", default=None,
                   help="The served model (default: the bundled SmolLM2-135M-Instruct GGUF).")
    p.add_argument("--out", required=True, type=Path, help="Folder for the head checkpoint.")
    p.add_argument("--max-steps", type=int, default=600, help="Optimizer steps in total.")
    p.add_argument("--num-prompts", type=int, default=256, help="Prompts answered for data.")
    p.add_argument("--max-tokens", type=int, default=128, help="Tokens per greedy answer.")
    p.add_argument("--prompts", type=Path, default=None,
                   help="A file of prompts: a .json list of strings, or one per line "
                        "(default: built-in templates).")
    p.add_argument("--draft-vocab-size", type=int, default=4096,
                   help="Tokens the head predicts (the answers' most frequent ones).")
    p.add_argument("--ttt-steps", type=int, default=3,
                   help="Draft steps unrolled in training (EAGLE-3's training-time test).")
    p.add_argument("--batch-size", type=int, default=4, help="Sequences per step.")
    p.add_argument("--lr", type=float, default=1e-3, help="Peak learning rate (AdamW).")
    p.add_argument("--save-every", type=int, default=100, help="Checkpoint every N steps.")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(list(argv))
    for name in ("max_steps", "num_prompts", "max_tokens", "draft_vocab_size", "ttt_steps",
                 "batch_size", "save_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.prompts is not None and not args.prompts.is_file():
        p.error(f"--prompts {args.prompts}: no such file")
    return args


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
            if k in _DATA_KEYS}


def _collect(args: argparse.Namespace, llm: Any, aux_layers: tuple[int, ...]) -> list[Sample]:
    runner, device = llm.engine.runner, llm.engine.device
    samples = []
    for ids, n_prompt in generate(llm, prompts(args.num_prompts, args.prompts), args.max_tokens):
        aux = capture_aux(runner.model, ids, aux_layers, device)
        samples.append(Sample(torch.tensor(ids), min(n_prompt, len(ids) - 1), aux))
    return samples


def _batch(samples: list[Sample], embed: Any, t2d: torch.Tensor, ttt: int
           ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(embeds of token p + 1, aux at p, labels of each step: draft id of token p + j + 2 or
    -100) for rows p of each sample, padded to one length."""
    t = max(len(s.token_ids) for s in samples) - 1
    b, h3 = len(samples), samples[0].aux.shape[1]
    aux = torch.zeros(b, t, h3)
    ids = torch.zeros(b, t, dtype=torch.int64)
    labels = [torch.full((b, t), -100, dtype=torch.int64) for _ in range(ttt)]
    for i, s in enumerate(samples):
        n = len(s.token_ids)
        aux[i, :n - 1] = s.aux[:n - 1].float()
        ids[i, :n - 1] = s.token_ids[1:]
        for j in range(ttt):
            first = max(s.num_prompt_tokens - j - 2, 0)
            if first < n - j - 2:
                labels[j][i, first:n - j - 2] = t2d[s.token_ids[first + j + 2:]]
    with torch.no_grad():
        embeds = embed.forward(ids.flatten()).float().view(b, t, -1)
    return embeds, aux, labels


def _loss(head: Eagle3Head, embeds: torch.Tensor, aux: torch.Tensor,
          labels: list[torch.Tensor]) -> tuple[torch.Tensor, list[float]]:
    """Weighted loss over the unrolled steps, and each step's top-1 accuracy."""
    hidden = head.forward_ttt(embeds, head.fc(aux), len(labels))
    total, accs = torch.zeros(()), []
    for j, (h, y) in enumerate(zip(hidden, labels, strict=True)):
        mask = y >= 0
        if not bool(mask.any()):
            accs.append(0.0)
            continue
        logits = head.lm_head(h[mask])
        total = total + 0.8**j * F.cross_entropy(logits, y[mask])
        accs.append(float((logits.argmax(-1) == y[mask]).float().mean()))
    return total, accs


def _lr(step: int, args: argparse.Namespace) -> float:
    warm = min(20, args.max_steps // 10 + 1)
    if step < warm:
        return args.lr * (step + 1) / warm
    progress = (step - warm) / max(args.max_steps - warm, 1)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def _load_or_collect(args: argparse.Namespace, llm: Any, aux_layers: tuple[int, ...],
                     state_dir: Path) -> list[Sample]:
    data_path = state_dir / "data.pt"
    if data_path.is_file():
        saved = torch.load(data_path, weights_only=False)
        if saved["settings"] == _settings(args):
            logger.info("Resuming: %d captured sequences from %s", len(saved["samples"]),
                        data_path)
            return saved["samples"]
    logger.info("Answering %d prompts greedily (up to %d tokens each) and capturing the "
                "model's hidden states of layers %s", args.num_prompts, args.max_tokens,
                list(aux_layers))
    samples = _collect(args, llm, aux_layers)
    state_dir.mkdir(parents=True, exist_ok=True)
    torch.save({"settings": _settings(args), "samples": samples}, data_path)
    return samples


def train(args: argparse.Namespace) -> Path:
    """Run (or resume) training; returns the checkpoint folder."""
    from tqdm import tqdm

    from sous import LLM
    from sous.models.llama_eagle3 import default_aux_layers

    torch.manual_seed(args.seed)
    llm = LLM(args.model, max_model_len=args.max_tokens + 1024)
    hf, model = llm.engine.model_info.hf_config, llm.engine.runner.model
    aux_layers = default_aux_layers(hf.num_hidden_layers)
    state_dir = args.out / ".train"
    samples = _load_or_collect(args, llm, aux_layers, state_dir)
    vocab = min(args.draft_vocab_size, hf.vocab_size)
    config = HeadConfig.for_target(hf, vocab, aux_layers, _rope_theta(hf))
    head = Eagle3Head(config)
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.0)
    state_path, step = state_dir / "state.pt", 0
    if state_path.is_file() and (saved := torch.load(state_path, weights_only=False))[
            "settings"] == _settings(args):
        head.load_state_dict(saved["head"])
        opt.load_state_dict(saved["optimizer"])
        step = saved["step"]
        torch.set_rng_state(saved["rng"])
        logger.info("Resuming training at step %d of %d", step, args.max_steps)
    else:
        ids = draft_vocabulary(samples, vocab, hf.vocab_size)
        with torch.no_grad():
            head.d2t.copy_(ids - torch.arange(vocab))
            head.lm_head.weight.copy_(dense_lm_head(model, hf.hidden_size,
                                                    llm.engine.device)[ids])
    t2d = torch.full((hf.vocab_size,), -100, dtype=torch.int64)
    t2d[head.d2t + torch.arange(vocab)] = torch.arange(vocab)
    embed = model.model.embed_tokens
    bar = tqdm(total=args.max_steps, initial=step, desc="Training the EAGLE-3 head", unit="step")
    while step < args.max_steps:
        for group in opt.param_groups:
            group["lr"] = _lr(step, args)
        pick = torch.randint(len(samples), (args.batch_size,)).tolist()
        embeds, aux, labels = _batch([samples[i] for i in pick], embed, t2d, args.ttt_steps)
        loss, accs = _loss(head, embeds, aux, labels)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", acc="/".join(f"{a:.2f}" for a in accs))
        if step % args.save_every == 0 or step == args.max_steps:
            _save(head, opt, step, args, state_path)
    bar.close()
    if not (args.out / "model.safetensors").is_file():
        _save(head, opt, step, args, state_path)
    return args.out


def _rope_theta(hf: Any) -> float:
    params = getattr(hf, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(hf, "rope_theta", 10000.0)))


def _save(head: Eagle3Head, opt: torch.optim.Optimizer, step: int, args: argparse.Namespace,
          state_path: Path) -> None:
    head.save(args.out)
    torch.save({"settings": _settings(args), "head": head.state_dict(),
                "optimizer": opt.state_dict(), "step": step, "rng": torch.get_rng_state()},
               state_path)


def main(argv: Sequence[str]) -> int:
    """`sous draft train ...`; other subcommands are errors (exit 2)."""
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: sous draft train --out DIR [--max-steps N] [options]\n\n"
              "Subcommands:\n  train  distil an EAGLE-3 draft head (`sous draft train -h`)")
        return 0 if argv else 2
    if argv[0] != "train":
        print(f"sous draft: error: unknown subcommand {argv[0]!r} (available: train)",
              file=sys.stderr)
        return 2
    args = parse_args(argv[1:])
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO,
                            format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    out = train(args)
    spec = json.dumps({"method": "eagle3", "model": str(out), "num_speculative_tokens": 3})
    print(f"Wrote {out}. Serve it with: sous serve {args.model or ''} --speculative-config "
          f"'{spec}'".replace("  ", " "))
    return 0
