"""The training corpus: the Python standard library's own sources split by a hash of the path
(or a given file / directory), a byte-level BPE tokenizer trained on it, token streams."""
from __future__ import annotations

import sysconfig
import zlib
from pathlib import Path
from typing import Iterable, List, Optional

import torch

# ---- corpus: the Python standard library's own sources, split by a hash of the path ----

_EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
_MAX_FILE_BYTES = 200_000  # generated tables (e.g. pydoc_data/topics.py) are not code


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relative_path: str) -> bool:
    """One file in ten is held out: crc32 of its path relative to the stdlib root, mod 10 == 0.
    Stable across Python versions (a path keeps its split)."""
    return zlib.crc32(relative_path.encode()) % 10 == 0


def stdlib_files(split: str, root: Optional[Path] = None) -> List[Path]:
    """The stdlib's .py files of `split` ("train" or "heldout"), sorted by path."""
    if split not in ("train", "heldout"):
        raise ValueError(f"stdlib_files: split must be 'train' or 'heldout', got {split!r}")
    root = root or stdlib_root()
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if _EXCLUDED_DIRS & set(rel.split("/")[:-1]) or path.stat().st_size > _MAX_FILE_BYTES:
            continue
        if is_heldout(rel) == (split == "heldout"):
            out.append(path)
    return out


def read_texts(paths: Iterable[Path]) -> List[str]:
    return [Path(p).read_bytes().decode("utf-8", errors="replace") for p in paths]


def corpus_texts(corpus: Optional[str]) -> List[str]:
    """A text corpus: None = the stdlib's train split; a file; or a directory (its .py / .txt /
    .md files, recursively)."""
    if corpus is None:
        return read_texts(stdlib_files("train"))
    path = Path(corpus)
    if path.is_file():
        return read_texts([path])
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in (".py", ".txt", ".md") and p.is_file())
        if files:
            return read_texts(files)
    raise ValueError(f"corpus: {corpus!r} is neither a text file nor a directory holding .py / .txt "
                     f"/ .md files")


# ---- tokenizer ----

EOS_TOKEN, MASK_TOKEN = "<|endoftext|>", "<|mask|>"


def train_tokenizer(texts: List[str], vocab_size: int):
    """A byte-level BPE tokenizer (`tokenizers`) with <|endoftext|> (id 0) and <|mask|> (id 1, the
    drafter's mask token), wrapped as a transformers PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN, MASK_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  min_frequency=2, show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN,
                                   mask_token=MASK_TOKEN)


def token_stream(tokenizer, texts: List[str]) -> torch.Tensor:
    """All texts encoded and concatenated, each followed by the end-of-text token (when the
    tokenizer has one): int64 [T]."""
    eos = tokenizer.eos_token_id
    ids: List[int] = []
    for enc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        if eos is not None:
            ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def random_windows(stream: torch.Tensor, count: int, length: int, g: torch.Generator) -> torch.Tensor:
    if stream.numel() <= length:
        raise ValueError(f"corpus: {stream.numel()} tokens, fewer than one window of {length + 1}")
    starts = torch.randint(0, stream.numel() - length, (count,), generator=g)
    return torch.stack([stream[s:s + length] for s in starts.tolist()])
