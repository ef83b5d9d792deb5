"""Tokenizer checks and prompt encoding.

Speculative decoding is lossless only if draft and target speak the same token ids:
the target verifies the draft's ids directly, with no re-tokenisation.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase


class TokenizerMismatchError(ValueError):
    """Draft and target tokenizers map text to different token ids."""


# Diverse strings: byte-level merges, unicode, whitespace runs and special-token
# markers are where near-identical tokenizers usually part ways.
PROBES: tuple[str, ...] = (
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def add(a: int, b: int) -> int:\n    return a + b\n",
    "for (int i = 0; i < n; ++i) { sum += x[i] * y[i]; }  // dot product",
    "    \t\t  \n\n\n        trailing   spaces   ",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n",
    "<|endoftext|><s></s>[INST] <<SYS>> [/INST]",
    "3.14159 2.71828 1234567890 -42 1e-9 0x1F 1,000,000 12:30",
    "naïve café Ünïcödé — “quotes” … ½ ∑ ∫ √2 ≠ π",
    "中文字符测试，日本語のテキスト，한국어 텍스트",
    "emoji: 😀🚀🐍👩‍💻 ✓ ✗",
    "Привет, мир! Γειά σου κόσμε! مرحبا بالعالم",
    '{"key": [1, 2, {"nested": null}], "s": "a\\"b"}',
    "```python\nimport numpy as np\nprint(np.arange(10).reshape(2, 5))\n```",
)


def check_same_tokenizer(
    a: PreTrainedTokenizerBase,
    b: PreTrainedTokenizerBase,
    *,
    names: tuple[str, str] = ("draft", "target"),
) -> None:
    """Raise ``TokenizerMismatchError`` unless ``a`` and ``b`` tokenize identically."""
    na, nb = names

    def fail(what: str) -> None:
        raise TokenizerMismatchError(
            f"the {na} and {nb} models use different tokenizers: {what}. Speculative decoding "
            f"needs the {na} and the {nb} to share one tokenizer (same model family)."
        )

    if len(a) != len(b):
        fail(f"vocabulary size {len(a)} ({na}) vs {len(b)} ({nb})")
    for attr in ("eos_token_id", "pad_token_id", "bos_token_id"):
        ia, ib = getattr(a, attr), getattr(b, attr)
        if ia != ib:
            fail(f"{attr} {ia} ({na}) vs {ib} ({nb})")
    for probe in PROBES:
        ia, ib = _ids(a, probe), _ids(b, probe)
        if ia != ib:
            fail(f"{probe!r} encodes to {ia} ({na}) vs {ib} ({nb})")
    va, vb = a.get_vocab(), b.get_vocab()
    if va != vb:  # same size, same probes, yet a different mapping somewhere
        tok = next(t for t in sorted(va.keys() | vb.keys()) if va.get(t) != vb.get(t))
        fail(f"token {tok!r} has id {va.get(tok)} ({na}) vs {vb.get(tok)} ({nb})")


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase,
    text: str,
    *,
    chat: bool = True,
    system: str | None = None,
) -> list[int]:
    """Token ids for ``text``: as one chat user turn (ready for the reply) or as plain text."""
    if not text or not text.strip():
        raise ValueError("prompt must not be empty")
    if chat and tokenizer.chat_template:
        messages = ([{"role": "system", "content": system}] if system is not None else [])
        messages.append({"role": "user", "content": text})
        # Render, then encode: the template already spells out every special token, and
        # this is exactly how apply_chat_template(tokenize=True) tokenizes, minus the
        # return-type differences between transformers versions.
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return _ids(tokenizer, rendered)
    if system is not None:  # no template to place it in: plain text, system first
        text = f"{system}\n\n{text}"
    return _ids(tokenizer, text)


def encode_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict], *, add_generation_prompt: bool = False) -> list[int]:
    """Token ids of a whole conversation (answers included), as the model sees it in chat.

    ``add_generation_prompt``: end with the template's opening of the assistant's reply (what a
    chat server continues from).
    """
    if tokenizer.chat_template:
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        return _ids(tokenizer, rendered)
    return _ids(tokenizer, "\n\n".join(message["content"] for message in messages))


def _ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
