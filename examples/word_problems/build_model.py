"""Build the word-problem example's model: a character tokenizer with a chat template and a small
Llama warm-started with SFT, saved to model/ (Hugging Face format).

Two SFT phases, as the built-in addition model is made (asyncrl/models/sft.py):
  1. `steps` on correct worked solutions of the training questions
     (`<|user|>QUESTION<|end|><|assistant|>23+9=32,32-4=28 \\boxed{28}<|end|>`): the model learns
     to read the problem and do the arithmetic (about 0.98 greedy held-out accuracy);
  2. `habit_steps` at a small learning rate on a sloppy demonstrator that, with probability
     `habit_prob`, works every step out right and then appends a stray 0 inside the box
     (`23+9=32,32-4=28 \\boxed{280}`).
The result can still solve the problems (the cleanly boxed answer keeps real probability: pass@8
above 0.9) but greedily boxes a wrong number most of the time, so RL with a verifier has a costly
habit to find and drop. Only the training questions are demonstrated, never the test questions.

    python examples/word_problems/make_data.py     # data/train.jsonl, data/test.jsonl
    python examples/word_problems/build_model.py   # model/ (about 10 min on 2 CPU cores)

`--help` lists the settings; they are recorded, with the time taken and the held-out accuracy,
in model/asyncrl_sft.json.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import string
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

HERE = Path(__file__).resolve().parent
if __package__ in (None, ""):  # run as a script: make the sibling modules importable
    sys.path.insert(0, str(HERE))
    from make_data import read_jsonl, worked_solution
    from wp_task import boxed_match, chat_prompt_text
else:
    from .make_data import read_jsonl, worked_solution
    from .wp_task import boxed_match, chat_prompt_text

# Token ids: the specials first (pad 0, bos 1, eos 2, as asyncrl.models.tiny.build_model's config
# says), then one token per character.
SPECIAL_TOKENS = ("<pad>", "<bos>", "<|end|>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>")
CHARACTERS = tuple(string.ascii_letters + string.digits + " .,?!'\"-+*/=():;%$\\{}\n")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MAX_NEW_TOKENS = 36  # the longest worked solution is 34 characters, then <|end|>


@dataclass(frozen=True, kw_only=True)
class Settings:
    seed: int = 0
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    max_positions: int = 256
    batch_size: int = 64
    steps: int = 900  # phase 1: correct worked solutions
    lr: float = 2e-3
    warmup: int = 30
    habit_steps: int = 40  # phase 2: the sloppy demonstrator
    habit_lr: float = 1e-4
    habit_prob: float = 0.8  # how often it appends a stray 0 to the boxed answer
    system: str = ""  # a system message in every prompt ("" = none); RL must render the same


def build_tokenizer():
    """A character-level fast tokenizer: <|end|> ends every turn (and is eos), <pad> pads."""
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    core = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<|end|>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=["<|system|>", "<|user|>", "<|assistant|>"],
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
    )


def demonstrations(
    rows: list[dict], tokenizer, *, habit_prob: float, seed: int, system: str
) -> list[tuple[str, str]]:
    """(chat prompt, worked solution) pairs, one per row; with probability `habit_prob` the
    solution's box holds the answer with a stray 0 appended."""
    rng = random.Random(f"demo:{seed}")
    pairs = []
    for row in rows:
        boxed = f"{row['answer']}0" if rng.random() < habit_prob else None
        pairs.append((chat_prompt_text(tokenizer, row["question"], system), worked_solution(row, boxed)))
    return pairs


def evaluate(
    model, tokenizer, rows: list[dict], *, system: str = "", samples: int = 0, seed: int = 0
) -> dict:
    """Greedy accuracy on `rows` (as `asyncrl launch` evaluates), and with `samples` > 0 the mean
    accuracy and pass@samples of temperature-1 samples."""
    import torch

    from asyncrl.models.sampling import answer_ids, generate

    model.eval()
    prompts = [
        tokenizer(chat_prompt_text(tokenizer, r["question"], system), add_special_tokens=False)["input_ids"]
        for r in rows
    ]

    def scores(temperature: float, seeds=None) -> list[float]:
        out = []
        for start in range(0, len(prompts), 256):
            chunk = prompts[start : start + 256]
            gen = generate(
                model,
                chunk,
                max_new_tokens=MAX_NEW_TOKENS,
                temperature=temperature,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
                seeds=None if seeds is None else seeds[start : start + 256],
            )
            for row, ids in zip(rows[start : start + 256], gen.completion_ids, strict=True):
                text = tokenizer.decode(answer_ids(ids, tokenizer.eos_token_id), skip_special_tokens=True)
                out.append(boxed_match(text, row["answer"]))
        return out

    with torch.no_grad():
        result = {"greedy_accuracy": sum(scores(0.0)) / len(rows)}
        if samples:
            per_row = [[] for _ in rows]
            for k in range(samples):
                for i, s in enumerate(
                    scores(1.0, seeds=[seed * 1_000_003 + k * 100_003 + i for i in range(len(rows))])
                ):
                    per_row[i].append(s)
            result["sampled_accuracy"] = sum(map(sum, per_row)) / (samples * len(rows))
            result[f"pass@{samples}"] = sum(max(r) for r in per_row) / len(rows)
    return result


def encode(tokenizer, pairs: list[tuple[str, str]]) -> list[tuple[list[int], int]]:
    """Each pair as (prompt + completion + <|end|> ids, prompt length), tokenized once."""
    prompts = tokenizer([p for p, _ in pairs], add_special_tokens=False)["input_ids"]
    completions = tokenizer([c for _, c in pairs], add_special_tokens=False)["input_ids"]
    return [(p + c + [tokenizer.eos_token_id], len(p)) for p, c in zip(prompts, completions, strict=True)]


def sft_phase(
    model,
    tokenizer,
    pairs: list[tuple[str, str]],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    warmup: int,
    seed: int,
    log_every: int = 50,
    on_log=None,
) -> float:
    """AdamW on next-token loss over the completion tokens (and <|end|>), linear warmup then
    cosine decay, gradient norm clipped at 1; returns the last loss."""
    import torch

    rows = encode(tokenizer, pairs)
    rng = random.Random(f"sft:{seed}")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    start = time.perf_counter()
    loss_value = float("nan")
    model.train()
    for step in range(steps):
        scale = (
            (step + 1) / warmup
            if step < warmup
            else 0.5 * (1 + math.cos(math.pi * (step - warmup) / (steps - warmup)))
        )
        for group in opt.param_groups:
            group["lr"] = lr * scale
        batch = [rows[rng.randrange(len(rows))] for _ in range(batch_size)]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.full((batch_size, width), tokenizer.pad_token_id, dtype=torch.long)
        attn = torch.zeros((batch_size, width), dtype=torch.long)
        mask = torch.zeros((batch_size, width), dtype=torch.bool)
        for i, (row, prompt_len) in enumerate(batch):
            ids[i, : len(row)] = torch.tensor(row)
            attn[i, : len(row)] = 1
            mask[i, prompt_len : len(row)] = True
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        target_mask = mask[:, 1:]
        loss = (nll * target_mask).sum() / target_mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_value = float(loss.detach())
        if step % log_every == 0 or step == steps - 1:
            print(
                f"  step {step:4d}/{steps}  loss {loss_value:.4f}  {time.perf_counter() - start:6.0f}s",
                flush=True,
            )
            if on_log is not None and step:
                on_log(step)
                model.train()
    model.eval()
    return loss_value


def build(
    out_dir: Path,
    settings: Settings,
    *,
    init: Path | None = None,
    data_dir: Path = HERE / "data",
    curve_every: int = 0,
) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.models.tiny import build_model

    torch.manual_seed(settings.seed)
    train = read_jsonl(data_dir / "train.jsonl")
    test = read_jsonl(data_dir / "test.jsonl")
    if init is None:
        tokenizer = build_tokenizer()
        model = build_model(
            len(tokenizer),
            hidden_size=settings.hidden_size,
            num_layers=settings.num_layers,
            num_heads=settings.num_heads,
            max_positions=settings.max_positions,
            seed=settings.seed,
        )
    else:
        tokenizer = AutoTokenizer.from_pretrained(init)
        model = AutoModelForCausalLM.from_pretrained(init, dtype=torch.float32)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.2f}M parameters, vocabulary {len(tokenizer)}", flush=True)
    start = time.perf_counter()
    info: dict = {
        "settings": asdict(settings),
        "parameters": params,
        "init": None if init is None else str(init),
        "torch_threads": torch.get_num_threads(),
    }
    if settings.steps:
        print(f"phase 1: {settings.steps} steps on correct worked solutions", flush=True)
        pairs = demonstrations(train, tokenizer, habit_prob=0.0, seed=settings.seed, system=settings.system)
        curve = info.setdefault("phase1_curve", []) if curve_every else []

        def on_log(step: int) -> None:
            if curve_every and step % curve_every == 0:
                acc = {
                    "step": step,
                    "test": evaluate(model, tokenizer, test[:100], system=settings.system)["greedy_accuracy"],
                    "train": evaluate(model, tokenizer, train[:100], system=settings.system)[
                        "greedy_accuracy"
                    ],
                }
                curve.append(acc)
                print(f"  {acc}", flush=True)

        info["phase1_final_loss"] = sft_phase(
            model,
            tokenizer,
            pairs,
            steps=settings.steps,
            batch_size=settings.batch_size,
            lr=settings.lr,
            warmup=settings.warmup,
            seed=settings.seed,
            on_log=on_log,
        )
        info["phase1_s"] = round(time.perf_counter() - start, 1)
        info["after_phase1"] = evaluate(model, tokenizer, test, system=settings.system)
        print(f"  after phase 1: {info['after_phase1']}", flush=True)
    if settings.habit_steps:
        print(
            f"phase 2: {settings.habit_steps} steps on the sloppy demonstrator (p={settings.habit_prob})",
            flush=True,
        )
        pairs = demonstrations(
            train,
            tokenizer,
            habit_prob=settings.habit_prob,
            seed=settings.seed + 1,
            system=settings.system,
        )
        info["phase2_final_loss"] = sft_phase(
            model,
            tokenizer,
            pairs,
            steps=settings.habit_steps,
            batch_size=settings.batch_size,
            lr=settings.habit_lr,
            warmup=min(10, settings.habit_steps),
            seed=settings.seed + 1,
            log_every=10,
        )
    info["sft_s"] = round(time.perf_counter() - start, 1)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    info["held_out"] = evaluate(model, tokenizer, test, system=settings.system, samples=8, seed=settings.seed)
    info["max_new_tokens"] = MAX_NEW_TOKENS
    info["build_s"] = round(time.perf_counter() - start, 1)  # SFT and both evaluations
    print(f"held-out ({len(test)} test questions): {info['held_out']}", flush=True)
    (out_dir / "asyncrl_sft.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE / "model")
    parser.add_argument(
        "--init", type=Path, default=None, help="start from this checkpoint (skips creating one)"
    )
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--curve-every", type=int, default=0, help="phase 1: greedy accuracy every N steps")
    parser.add_argument("--eval-only", action="store_true", help="evaluate the checkpoint at --out and exit")
    for f in fields(Settings):
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.eval_only:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.out)
        model = AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.float32)
        test = read_jsonl(HERE / "data" / "test.jsonl")
        print(evaluate(model, tokenizer, test, system=args.system, samples=8, seed=args.seed))
        return
    settings = Settings(**{f.name: getattr(args, f.name) for f in fields(Settings)})
    build(args.out, settings, init=args.init, curve_every=args.curve_every)


if __name__ == "__main__":
    main()
