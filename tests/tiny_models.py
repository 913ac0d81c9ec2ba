"""Tiny random checkpoints (every architecture the tests build through transformers' configs),
greedy decoding with transformers as the reference, and a test tokenizer: what the model tests
share (tests/helpers.py re-exports them)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch and transformers load only in the tests that build models
    import torch

VOCAB = 384
COMMON: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                              num_hidden_layers=2, max_position_embeddings=512,
                              bos_token_id=1, eos_token_id=2, pad_token_id=0)

# name -> (transformers config class, model class, extra config kwargs)
TINY_MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {
    # GQA, untied, Llama 3.1 rope scaling written the classic way (transformers 5 moves it
    # into rope_parameters on save, so both spellings are exercised by the config tests).
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
        rope_theta=50000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    # MHA, tied embeddings.
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True)),
    # head_dim from config (32) unrelated to hidden / heads (16), GQA 4:1.
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, tie_word_embeddings=False,
        sliding_window=None)),
    # qkv bias, tied.
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
        rope_theta=1000000.0)),
    # per-head q/k RMSNorm, head_dim 32, untied.
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)),
    # Gemma 3: local layers with a 6-token window (not a multiple of the tests' block sizes,
    # so windows start mid-block; prompts run far past it) around one global layer, each kind
    # with its own RoPE (linear scaling on the global one, as the 4B+ models have), one KV
    # head, head_dim 32 != hidden / heads, a query scale that is not head_dim, tied.
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
        query_pre_attn_scalar=24, sliding_window=6, tie_word_embeddings=True,
        layer_types=["sliding_attention", "sliding_attention", "full_attention",
                     "sliding_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
}


@dataclass
class TinyModel:
    name: str
    path: Path
    hf: torch.nn.Module


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights with a spread large enough that logits are far from ties (std 0.02 is not).

    Gemma multiplies the embedding by sqrt(hidden) and ties the LM head, so with the same
    spread the input token's own embedding dominates the residual stream and greedy decoding
    just repeats it: its embeddings are smaller and its norms (which scale by 1 + w) stronger.
    """
    import torch

    gemma = getattr(getattr(model, "config", None), "model_type", "") == "gemma3_text"
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_((3.0 if gemma else 1.0) + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.2 * noise)
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(0.25 * noise if gemma else noise)
            else:
                p.copy_(noise / p.shape[-1] ** 0.5)


def build_tiny(name: str, folder: Path, seed: int = 0, **overrides: Any) -> TinyModel:
    import torch
    import transformers

    config_name, model_name, extra = TINY_MODELS[name]
    config = getattr(transformers, config_name)(**{**COMMON, **extra, **overrides})
    model_cls = getattr(transformers, model_name)
    torch.manual_seed(seed)
    hf = model_cls(config).eval()
    randomize(hf, seed)
    hf.save_pretrained(folder)
    hf.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    return TinyModel(name, folder, hf)


def hf_greedy(hf: torch.nn.Module, prompt: list[int], n: int
              ) -> tuple[list[int], list[torch.Tensor]]:
    """Hugging Face greedy decoding: the tokens, and each step's log-probabilities."""
    import torch

    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                          dtype=torch.long), max_new_tokens=n, min_new_tokens=0,
                          do_sample=False, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(step[0].float(), dim=-1) for step in out.logits]
    return tokens, logprobs


TOKENIZER_BOS, TOKENIZER_EOS = 0, 1
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
_CORPUS = [
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer",
    "The slings and arrows of outrageous fortune, or to take arms against a sea of troubles",
    "Héllo wörld, naïve café. Ünïcödé 日本語のテキスト 🎉🚀 emoji and ümlauts.",
    "Now is the winter of our discontent made glorious summer by this sun of York.",
] * 20


def build_tokenizer(path: Path, vocab_size: int = 320) -> None:
    """A byte-level BPE tokenizer trained on a few lines (Unicode included), saved to path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", TOKENIZER_BOS)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


def build_bigram_model(folder: Path, tokenizer: Any, chains: list[list[int]],
                       seed: int = 0) -> None:
    """A Llama checkpoint that is a bigram model: attention and MLP write nothing, so the
    next token depends on the last one only, and each chain [t0, t1, ...] makes t_i+1 the
    likeliest token after t_i (elsewhere the logits are small noise). Saved with `tokenizer`
    (and its chat template). It lets a test script what a real model writes where a grammar
    leaves a choice: text, a tool-call tag, EOS."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = len(tokenizer)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096, bos_token_id=TOKENIZER_BOS,
                         eos_token_id=TOKENIZER_EOS, pad_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    hf = LlamaForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        emb = torch.randn(vocab, 64, generator=gen)
        hf.model.embed_tokens.weight.copy_(emb)
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        hf.model.norm.weight.fill_(1.0)
        unit = emb / emb.norm(dim=1, keepdim=True)
        head = torch.randn(vocab, 64, generator=gen) * 0.05
        for chain in chains:
            for a, b in zip(chain, chain[1:], strict=False):
                head[b] += 4.0 * unit[a]
        hf.lm_head.weight.copy_(head)
    hf.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
