"""Train pdcluster's default model: a tiny Qwen2-style code model with one MTP layer.

No model hub is reachable from our machines, so the model every config, test and benchmark
uses is made here, from the Python standard library of the running interpreter:

1. corpus: every ``.py`` file of the stdlib except the test suites, split by a hash of the
   relative path into train and held-out files (held-out files are never trained on);
2. tokenizer: byte-level BPE (``tokenizers``) with chat special tokens and a chat template;
3. model: a Qwen2 decoder plus one MTP layer in MiMo's layout (``MiMoForCausalLM``,
   ``num_nextn_predict_layers: 1``), trained jointly on next-token loss and the MTP head's
   t+2 loss, seeded, for a fixed number of steps;
4. output: a HF-style directory (``config.json``, ``model.safetensors``, tokenizer files),
   ``heldout_prompts.jsonl`` (prompts from held-out files) and ``train_report.json``.

``tools/model_card.py`` then measures the model through vLLM and writes ``MODEL_CARD.md``.

Usage: python tools/train_tiny_model.py --out models/pdcluster-tiny-code [--steps N]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import random
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

logger = logging.getLogger("train_tiny_model")

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}


@dataclass
class ModelShape:
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


# ----------------------------------------------------------------------------------------------
# Corpus and tokenizer
# ----------------------------------------------------------------------------------------------


def stdlib_files() -> list[tuple[str, Path]]:
    """(relative path, path) of every stdlib source file outside the test suites, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if EXCLUDED_DIRS.intersection(rel.parts[:-1]):
            continue
        files.append((rel.as_posix(), path))
    return sorted(files)


def is_heldout(rel_path: str, heldout_percent: int) -> bool:
    """Deterministic split: a file is held out by the hash of its relative path."""
    digest = hashlib.sha256(rel_path.encode()).digest()
    return int.from_bytes(digest[:4], "little") % 100 < heldout_percent


def read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None


def train_tokenizer(texts: list[str], vocab_size: int, out_dir: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 4096
    fast.save_pretrained(out_dir)
    return fast


# ----------------------------------------------------------------------------------------------
# Model: Qwen2 math with HF parameter names, plus MiMo's MTP layer
# ----------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype) * self.weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, s: ModelShape):
        super().__init__()
        self.s = s
        d = s.head_dim
        self.q_proj = nn.Linear(s.hidden_size, s.num_attention_heads * d, bias=True)
        self.k_proj = nn.Linear(s.hidden_size, s.num_key_value_heads * d, bias=True)
        self.v_proj = nn.Linear(s.hidden_size, s.num_key_value_heads * d, bias=True)
        self.o_proj = nn.Linear(s.num_attention_heads * d, s.hidden_size, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        d = self.s.head_dim
        q = self.q_proj(x).view(b, t, -1, d).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, d).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, d).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, s: ModelShape):
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, s: ModelShape):
        super().__init__()
        self.self_attn = Attention(s)
        self.mlp = MLP(s)
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class MTPLayer(nn.Module):
    """MiMo MTP: concat(norm(h_t), norm(embed(x_{t+1}))) -> proj -> decoder layer -> norm."""

    def __init__(self, s: ModelShape):
        super().__init__()
        self.token_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.hidden_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.input_proj = nn.Linear(2 * s.hidden_size, s.hidden_size, bias=False)
        self.final_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        layer = DecoderLayer(s)
        # vLLM's checkpoint layout keeps the block's modules directly on the MTP layer.
        self.self_attn = layer.self_attn
        self.mlp = layer.mlp
        self.input_layernorm = layer.input_layernorm
        self.post_attention_layernorm = layer.post_attention_layernorm

    def forward(self, hidden, next_embeds, cos, sin):
        # vLLM masks the token embedding at position 0 (MiMoMultiTokenPredictorLayer).
        next_embeds = next_embeds.clone()
        next_embeds[:, 0] = 0
        x = self.input_proj(torch.cat([self.hidden_layernorm(hidden), self.token_layernorm(next_embeds)], -1))
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return self.final_layernorm(x)


class Backbone(nn.Module):
    def __init__(self, s: ModelShape):
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(s) for _ in range(s.num_hidden_layers))
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.mtp_layers = nn.ModuleList([MTPLayer(s)])


class TinyMTPModel(nn.Module):
    def __init__(self, s: ModelShape):
        super().__init__()
        self.s = s
        self.model = Backbone(s)
        self.lm_head = nn.Linear(s.hidden_size, s.vocab_size, bias=False)
        inv_freq = 1.0 / (s.rope_theta ** (torch.arange(0, s.head_dim, 2, dtype=torch.float32) / s.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.apply(self._init)

    @staticmethod
    def _init(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def rope(self, t: int):
        freqs = torch.outer(torch.arange(t, dtype=torch.float32), self.inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos()[None, None], emb.sin()[None, None]

    def forward(self, tokens: torch.Tensor):
        """tokens: [B, T + 2]. Returns (main loss, mtp loss, mtp/main agreement)."""
        inputs, t = tokens[:, :-2], tokens.shape[1] - 2
        cos, sin = self.rope(t)
        x = self.model.embed_tokens(inputs)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        hidden = x  # pre-norm, as vLLM's MiMoModel hands it to the MTP layer
        main_logits = self.lm_head(self.model.norm(hidden))
        next_embeds = self.model.embed_tokens(tokens[:, 1:-1])
        mtp_hidden = self.model.mtp_layers[0](hidden, next_embeds, cos, sin)
        mtp_logits = self.lm_head(mtp_hidden)
        v = self.s.vocab_size
        main_loss = F.cross_entropy(main_logits.reshape(-1, v).float(), tokens[:, 1:-1].reshape(-1))
        mtp_loss = F.cross_entropy(mtp_logits.reshape(-1, v).float(), tokens[:, 2:].reshape(-1))
        with torch.no_grad():
            # What vLLM's greedy acceptance measures: the draft for t+2 equals the main
            # model's own choice at t+1.
            agree = (mtp_logits[:, :-1].argmax(-1) == main_logits[:, 1:].argmax(-1)).float().mean()
        return main_loss, mtp_loss, agree

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters under the names vLLM's MiMo loader expects (HF Qwen2 + mtp_layers)."""
        return {k: v.detach().contiguous() for k, v in self.state_dict().items()}


def hf_config(s: ModelShape, tokenizer) -> dict:
    return {
        "architectures": ["MiMoForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": s.vocab_size,
        "hidden_size": s.hidden_size,
        "intermediate_size": s.intermediate_size,
        "num_hidden_layers": s.num_hidden_layers,
        "num_attention_heads": s.num_attention_heads,
        "num_key_value_heads": s.num_key_value_heads,
        "head_dim": s.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": s.max_position_embeddings,
        "rms_norm_eps": s.rms_norm_eps,
        "rope_theta": s.rope_theta,
        "rope_parameters": {"rope_theta": s.rope_theta, "rope_type": "default"},
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "attention_dropout": 0.0,
        "num_nextn_predict_layers": 1,
        "torch_dtype": "bfloat16",
        "bos_token_id": None,
        "eos_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        "pad_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    }


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------


def make_prompts(heldout_texts: list[tuple[str, str]], tokenizer, n: int, seed: int) -> list[dict]:
    """Prompts cut from held-out files at line starts: 24-96 tokens of real code each."""
    rng = random.Random(seed)
    prompts = []
    candidates = [(rel, text) for rel, text in heldout_texts if len(text) > 2000]
    while len(prompts) < n:
        rel, text = rng.choice(candidates)
        lines = text.splitlines(keepends=True)
        start = rng.randrange(0, max(1, len(lines) - 40))
        chunk = "".join(lines[start : start + 40])
        ids = tokenizer(chunk)["input_ids"]
        if len(ids) < 32:
            continue
        keep = rng.randrange(24, min(96, len(ids) - 4))
        prompt = tokenizer.decode(ids[:keep])
        prompts.append({"source": rel, "prompt": prompt})
    return prompts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("models/pdcluster-tiny-code"))
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=384)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--mtp-weight", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--heldout-percent", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    started = time.monotonic()

    s = ModelShape()
    train_texts, heldout_texts = [], []
    for rel, path in stdlib_files():
        text = read_text(path)
        if text is None:
            continue
        (heldout_texts if is_heldout(rel, args.heldout_percent) else train_texts).append((rel, text))
    logger.info("corpus: %d train files, %d held-out files", len(train_texts), len(heldout_texts))

    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer([t for _, t in train_texts], s.vocab_size, args.out)
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")

    def encode_all(texts):
        ids: list[int] = []
        for _, text in texts:
            ids.extend(tokenizer(text)["input_ids"])
            ids.append(eot)
        return torch.tensor(ids, dtype=torch.long)

    train_ids, heldout_ids = encode_all(train_texts), encode_all(heldout_texts)
    logger.info("tokens: %d train, %d held-out", train_ids.numel(), heldout_ids.numel())

    model = TinyMTPModel(s)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("parameters: %.2f M", n_params / 1e6)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, args.steps // 30)

    def lr_at(step):
        if step < warmup:
            return args.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    gen = torch.Generator().manual_seed(args.seed)
    window = args.seq_len + 2

    def batch_from(ids):
        starts = torch.randint(0, ids.numel() - window, (args.batch,), generator=gen)
        return torch.stack([ids[i : i + window] for i in starts.tolist()])

    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16)
    losses = []
    for step in range(args.steps):
        for group in optim.param_groups:
            group["lr"] = lr_at(step)
        with autocast:
            main_loss, mtp_loss, agree = model(batch_from(train_ids))
        loss = main_loss + args.mtp_weight * mtp_loss
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        losses.append((main_loss.item(), mtp_loss.item(), agree.item()))
        if step % 50 == 0 or step == args.steps - 1:
            recent = losses[-50:]
            logger.info(
                "step %d/%d main %.3f mtp %.3f agree %.3f (%.0f s)",
                step,
                args.steps,
                sum(r[0] for r in recent) / len(recent),
                sum(r[1] for r in recent) / len(recent),
                sum(r[2] for r in recent) / len(recent),
                time.monotonic() - started,
            )
    train_seconds = time.monotonic() - started

    model.eval()
    heldout = {"main_loss": 0.0, "mtp_loss": 0.0, "next_token_accuracy": 0.0, "mtp_agreement": 0.0}
    eval_batches = 20
    with torch.no_grad(), autocast:
        for _ in range(eval_batches):
            tokens = batch_from(heldout_ids)
            main_loss, mtp_loss, agree = model(tokens)
            heldout["main_loss"] += main_loss.item() / eval_batches
            heldout["mtp_loss"] += mtp_loss.item() / eval_batches
            heldout["mtp_agreement"] += agree.item() / eval_batches
            heldout["next_token_accuracy"] += next_token_accuracy(model, tokens) / eval_batches

    state = {k: v.to(torch.bfloat16) for k, v in model.hf_state_dict().items()}
    save_file(state, str(args.out / "model.safetensors"), metadata={"format": "pt"})
    (args.out / "config.json").write_text(json.dumps(hf_config(s, tokenizer), indent=2) + "\n")
    (args.out / "generation_config.json").write_text(
        # greedy by default: see the model card's limitations (tools/model_card.py)
        json.dumps({"eos_token_id": eot, "pad_token_id": eot, "temperature": 0.0}, indent=2) + "\n"
    )
    prompts = make_prompts(heldout_texts, tokenizer, 50, args.seed)
    with open(args.out / "heldout_prompts.jsonl", "w") as f:
        for p in prompts:
            f.write(json.dumps(p) + "\n")
    tail = losses[-100:]
    report = {
        "shape": asdict(s),
        "parameters": n_params,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "corpus": {
            "stdlib": sysconfig.get_paths()["stdlib"],
            "train_files": len(train_texts),
            "heldout_files": len(heldout_texts),
            "train_tokens": train_ids.numel(),
            "heldout_tokens": heldout_ids.numel(),
            "tokens_seen": args.steps * args.batch * args.seq_len,
        },
        "train_seconds": round(train_seconds, 1),
        "final_train": {
            "main_loss": sum(r[0] for r in tail) / len(tail),
            "mtp_loss": sum(r[1] for r in tail) / len(tail),
        },
        "heldout": heldout,
        "torch": torch.__version__,
    }
    (args.out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    logger.info("done in %.0f s: %s", train_seconds, json.dumps(report["heldout"]))


def next_token_accuracy(model: TinyMTPModel, tokens: torch.Tensor) -> float:
    inputs = tokens[:, :-2]
    cos, sin = model.rope(inputs.shape[1])
    x = model.model.embed_tokens(inputs)
    for layer in model.model.layers:
        x = layer(x, cos, sin)
    pred = model.lm_head(model.model.norm(x)).argmax(-1)
    return (pred == tokens[:, 1:-1]).float().mean().item()


if __name__ == "__main__":
    main()
