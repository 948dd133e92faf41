"""A tiny random chat model: a byte-level fast tokenizer with a ChatML template next to a tiny random target.

Loads in well under a second (SmolLM2's GGUF tokenizer takes ~15 s to convert), yet goes through every chat path:
chat template, assistant loss masks, eos stops, regeneration and held-out prompts.
"""

from __future__ import annotations

import json
from pathlib import Path

from conftest import make_tiny_target

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB = 320  # 256 bytes + 3 specials, padded: the rows past the tokenizer are free for the mask token


def make_byte_tokenizer(reverse: bool = False):
    """A byte-level ChatML tokenizer; reverse=True numbers the same bytes the other way round (other ids, the same
    size and template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), reverse=reverse)
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", additional_special_tokens=SPECIALS)
    fast.chat_template = CHATML
    return fast


def make_tiny_chat_target(path, kind: str = "llama", seed: int = 0, **overrides) -> str:
    """A tiny random target directory that also holds its (byte-level, ChatML) tokenizer."""
    tok = make_byte_tokenizer()
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    out = make_tiny_target(path, kind, seed, vocab_size=VOCAB, **ids, **overrides)
    tok.save_pretrained(out)
    return out


def write_chats(path: Path, n: int, turns: int = 1) -> Path:
    """n ShareGPT records with ids; `turns` user/assistant exchanges each."""
    with open(path, "w") as f:
        for i in range(n):
            conv = []
            for t in range(turns):
                conv += [{"from": "human", "value": f"Question {i}.{t}: what is {i} plus {t}?"},
                         {"from": "gpt", "value": f"It is {i + t}."}]
            f.write(json.dumps({"id": f"chat{i}", "conversations": conv}) + "\n")
    return path
