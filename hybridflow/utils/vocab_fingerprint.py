"""One string that says whether two tokenizers share a vocabulary (a teacher must score the student's ids).

Two models can be distilled token for token only when every id means the same token to both: equal
vocabulary sizes are not enough (two BPEs of 2,000 tokens differ). The fingerprint is a SHA-256 over the
tokenizer's ``token -> id`` map (added tokens included), in id order.
"""

from __future__ import annotations

import hashlib


def vocab_fingerprint(tokenizer) -> str:
    """``sha256:<hex>`` of ``tokenizer.get_vocab()`` listed in id order as ``id\\ttoken`` lines."""
    vocab = tokenizer.get_vocab()
    digest = hashlib.sha256()
    for token, index in sorted(vocab.items(), key=lambda item: item[1]):
        digest.update(f"{index}\t{token}\n".encode("utf-8", "surrogatepass"))
    return f"sha256:{digest.hexdigest()}"
