"""Tiny tokenizers in the real classes, trained offline with the ``tokenizers`` library (docs/DESIGN.md section 4).

Nothing is downloaded: each tokenizer is trained on a small corpus (the PartiPrompts-like sentences below
plus the krea prompts shipped in ``bcg_core/data``) and built directly from its vocab (and merges), as
transformers 5.x accepts them. Each builder returns a tokenizer object that ``save_pretrained`` writes and
``AutoTokenizer.from_pretrained`` reads back.
"""

from __future__ import annotations

import csv
import importlib.resources
import string
from functools import lru_cache

__all__ = ["clip_tokenizer", "corpus", "t5_tokenizer"]

_EXTRA = [
    "a photo of a cat sitting on a red chair",
    "an astronaut riding a horse on the moon, digital art",
    "A watercolor painting of a lighthouse at dusk",
    "blurry, low quality, watermark, text",
    "portrait of an old man, studio lighting, 85mm",
]


@lru_cache(maxsize=1)
def corpus() -> tuple[str, ...]:
    """Training sentences: the krea prompts of ``bcg_core/data`` and a few fixed ones (deterministic)."""
    path = importlib.resources.files("bcg_core") / "data" / "krea_open_prompts_1k_flat.csv"
    with path.open(newline="", encoding="utf-8") as f:
        prompts = [row["prompt"] for row in csv.DictReader(f) if row["prompt"].strip()]
    return tuple(_EXTRA + prompts[:400])


def clip_tokenizer(vocab_size: int = 600, max_length: int = 77):
    """A ``CLIPTokenizer``: byte-level-free BPE with the ``</w>`` word suffix, eos at the highest id.

    CLIP pools its text at the eos id (``CLIPTextModel`` uses ``eos_token_id`` from its config, or the
    argmax id when that is 2): the eos token is given the highest id so either rule finds it.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import CLIPTokenizer

    tok = Tokenizer(models.BPE(unk_token="<|endoftext|>", end_of_word_suffix="</w>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, end_of_word_suffix="</w>",
                                  initial_alphabet=list(string.ascii_lowercase + string.digits + string.punctuation),
                                  special_tokens=[])
    tok.train_from_iterator([s.lower() for s in corpus()], trainer)
    vocab = dict(tok.get_vocab())
    merges = [tuple(m) if not isinstance(m, str) else tuple(m.split(" ")) for m in _bpe_merges(tok)]
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=max_length)


def _bpe_merges(tok) -> list:
    import json

    return json.loads(tok.to_str())["model"]["merges"]


def t5_tokenizer(vocab_size: int = 400, max_length: int = 512):
    """A ``T5Tokenizer`` (Unigram, ``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2, as T5's real vocab).

    The unigram trainer gets an initial alphabet with capitals, else "A" would be unknown.
    """
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import T5Tokenizer

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.UnigramTrainer(
        vocab_size=vocab_size, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>",
        initial_alphabet=list(string.ascii_letters + string.digits + string.punctuation),
    )
    tok.train_from_iterator(list(corpus()), trainer)
    vocab = [tuple(v) for v in json.loads(tok.to_str())["model"]["vocab"]]
    return T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=max_length)
