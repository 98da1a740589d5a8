"""What a text's length proves about its token count, read from a ``tokenizers``
configuration without tokenizing: a request whose text cannot fit the context is refused
before any tokenizer sees it (the endpoint, ``agentenv serve``)."""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import tokenizers

__all__ = ["TextBound", "text_bound"]


# A Unicode normalizer (NFC, NFD, NFKC, NFKD, Lowercase) maps a character of n UTF-8 bytes
# to at least n/4 bytes (checked over every code point: the worst is a 4-byte compatibility
# character that becomes one ASCII byte), so text shrinks at most 4-fold under each.
_UNICODE_NORMALIZERS = frozenset({"NFC", "NFD", "NFKC", "NFKD", "Lowercase"})
# Pre-tokenizers that split text without dropping any of it.
_KEEPING_PRE_TOKENIZERS = frozenset(
    {"ByteLevel", "Digits", "Metaspace", "Split", "Punctuation", "UnicodeScripts"}
)


def _shrink(normalizer: Any) -> int | None:
    """At most how many bytes of text become one byte of normalized text (None: no bound,
    e.g. a normalizer that strips characters)."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type") if isinstance(normalizer, dict) else None
    if kind == "Sequence":
        factor = 1
        for step in normalizer.get("normalizers") or []:
            f = _shrink(step)
            if f is None:
                return None
            factor *= f
        return factor
    if kind in _UNICODE_NORMALIZERS:
        return 4
    if kind == "Prepend":  # adds text
        return 1
    if kind == "Replace":  # a literal string replaced by a non-empty one
        pattern = normalizer.get("pattern") or {}
        literal = pattern.get("String") if isinstance(pattern, dict) else None
        content = normalizer.get("content")
        if isinstance(literal, str) and literal and isinstance(content, str) and content:
            return -(-len(literal.encode()) // len(content.encode()))
    return None


def _keeps_text(pre: Any) -> bool:
    if pre is None:
        return True
    kind = pre.get("type") if isinstance(pre, dict) else None
    if kind == "Sequence":
        return all(_keeps_text(p) for p in pre.get("pretokenizers") or [])
    if kind == "Split" or kind == "Punctuation":
        return bool(pre.get("behavior") != "Removed")
    return kind in _KEEPING_PRE_TOKENIZERS


@dataclasses.dataclass(frozen=True, slots=True)
class TextBound:
    """What a text's length proves about its token count, without tokenizing it.

    ``max_token_bytes``: at most how many bytes of text one token stands for; ``dropped``:
    ASCII characters the tokenizer drops (their bytes have no token). A text of ``n``
    characters (so at least ``n`` bytes), ``d`` of them dropped, is at least
    ``(n - d) / max_token_bytes`` tokens, whatever it says.
    """

    max_token_bytes: int
    dropped: str = ""

    def fewest_tokens(self, text: str) -> int:
        """A lower bound on the number of tokens of ``text``."""
        n = len(text)
        for ch in self.dropped:
            n -= text.count(ch)
        return max(0, -(-n // self.max_token_bytes))

    def may_fit(self, text: str, tokens: int) -> bool:
        """False when ``text`` is surely more than ``tokens`` tokens (a length check, and
        a count of the dropped characters only when the length alone says it is not)."""
        limit = tokens * self.max_token_bytes
        n = len(text)
        for ch in self.dropped:
            if n <= limit:
                break
            n -= text.count(ch)
        return n <= limit


def text_bound(tok: tokenizers.Tokenizer) -> TextBound | None:
    """The :class:`TextBound` of ``tok``, or None when its configuration proves none.

    Proven for BPE that keeps every byte of text (byte-level, byte fallback, or one unknown
    token per character) behind pre-tokenizers that drop nothing and normalizers that
    shrink text by a known factor: the longest token (vocabulary or added) times that
    factor.
    """
    config = json.loads(tok.to_str())
    model = config.get("model") or {}
    if model.get("type") != "BPE" or not _keeps_text(config.get("pre_tokenizer")):
        return None
    shrink = _shrink(config.get("normalizer"))
    vocab: dict[str, int] = model.get("vocab") or {}
    if shrink is None or not vocab:
        return None
    dropped = ""
    if '"ByteLevel"' in json.dumps(config.get("pre_tokenizer")):
        # Each character of a byte-level token is one byte of text, and a byte without a
        # token is dropped. The bound counts characters (each at least one byte): an ASCII
        # one dropped is counted out; a longer one keeps at least its continuation bytes
        # (0x80-0xBF), which must all have tokens, whatever its lead byte.
        for byte, char in enumerate(_BYTE_CHARS):
            if char in vocab or byte >= 0xC0:
                continue
            if byte >= 0x80 or shrink != 1:
                return None
            dropped += chr(byte)
        longest = max(len(t) for t in vocab)
    else:
        if model.get("byte_fallback"):
            if any(f"<0x{b:02X}>" not in vocab for b in range(256)):
                return None
        elif model.get("unk_token") is None or model.get("fuse_unk"):
            return None  # unknown text dropped, or any run of it one token
        longest = max(4, max(len(t.encode()) for t in vocab))  # (an unknown: one char)
    added = [len(a.content.encode()) for a in tok.get_added_tokens_decoder().values()]
    return TextBound(max([longest, *added]) * shrink, dropped)


def _byte_chars() -> tuple[str, ...]:
    # GPT-2's byte-to-character table: the character byte-level BPE writes each byte as.
    printable = {*range(33, 127), *range(161, 173), *range(174, 256)}
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return tuple(chars)


_BYTE_CHARS = _byte_chars()
