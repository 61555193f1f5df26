"""Training text that ships with Python itself, and a small byte-level BPE tokenizer trained on it.

The corpus is English prose from the standard library: ``pydoc_data.topics`` (the language reference
topics) and the docstrings of the pure-Python standard-library modules, extracted with ``ast`` — no
download, license-clean (PSF), identical on every machine with the same Python version.
"""

from __future__ import annotations

import ast
import sysconfig
from pathlib import Path

import torch
from torch import Tensor

from .errors import check_int

__all__ = ["stdlib_corpus", "train_tokenizer", "token_stream", "BOS", "EOS", "PAD"]

BOS, EOS, PAD = "<s>", "</s>", "<pad>"


def _docstrings(path: Path) -> list[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc) > 80:
                out.append(" ".join(doc.split()))
    return out


def stdlib_corpus(max_chars: int | None = None) -> list[str]:
    """Paragraphs of English: pydoc topics, then standard-library docstrings (sorted, deterministic)."""
    from pydoc_data.topics import topics

    texts = [" ".join(topics[k].split()) for k in sorted(topics)]
    lib = Path(sysconfig.get_paths()["stdlib"])
    total = sum(len(t) for t in texts)
    for path in sorted(lib.glob("*.py")) + sorted(lib.glob("*/*.py")):
        if max_chars is not None and total >= max_chars:
            break  # the cap is reached: parse no more files (same result, much faster for small caps)
        if "test" in path.parts or "idlelib" in path.parts:
            continue
        found = _docstrings(path)
        texts.extend(found)
        total += sum(len(t) for t in found)
    if max_chars is not None:
        kept, total = [], 0
        for t in texts:
            if total >= max_chars:
                break
            kept.append(t)
            total += len(t)
        texts = kept
    return texts


def train_tokenizer(texts: list[str], vocab_size: int = 4096):
    """A byte-level BPE tokenizer (``tokenizers``) that prepends ``<s>`` to every text, as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    check_int("vocab_size", vocab_size, 300, " (256 bytes + specials + merges)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD, BOS, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, bos)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD)


def token_stream(tokenizer, texts: list[str]) -> Tensor:
    """All texts tokenised without special tokens and joined with EOS: one long 1-D id tensor."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for t in texts:
        ids.extend(tokenizer(t, add_special_tokens=False, verbose=False)["input_ids"])
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)
