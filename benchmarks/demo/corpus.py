"""Local text corpora and the shared byte-level BPE tokenizer (no network, any machine with Python).

Two kinds of text are gathered from the machine itself:

- ``code``: the Python standard library's sources (``<stdlib>/*.py`` and ``<stdlib>/*/*.py``);
- ``prose``: ``/usr/share/common-licenses/*`` and ``/usr/share/doc/*/copyright`` (exact
  duplicates dropped).

Every file goes to exactly one split, decided by a hash of its name (not its location), so the
held-out slice (:func:`heldout_texts`, about 1 file in :data:`HELDOUT_EVERY`) is the same on
every machine that has the file, and disjoint from :func:`corpus_texts`.

:func:`train_tokenizer` trains the byte-level BPE tokenizer (~2000 tokens including
``<unk> <s> </s> <pad>``; a post-processor prepends ``<s>``) used by both the demo models and the
engine tests' tiny models; :func:`wrap_tokenizer` makes it a ``PreTrainedTokenizerFast``.
"""

from __future__ import annotations

import functools
import hashlib
import sysconfig
from pathlib import Path
from typing import Any, Literal

Kind = Literal["code", "prose"]
KINDS: tuple[Kind, ...] = ("code", "prose")

VOCAB_SIZE = 2000
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")
# Enough text for 2000 merges while training stays ~1-2 s on 2 cores.
TOKENIZER_MAX_CHARS = 3_000_000
# Caps on the text read per kind (the standard library alone holds ~25 MB of sources).
KIND_MAX_CHARS: dict[Kind, int] = {"code": 8_000_000, "prose": 8_000_000}
HELDOUT_EVERY = 20
LICENSES = Path("/usr/share/common-licenses")
DOC = Path("/usr/share/doc")


def stdlib_dir() -> Path:
    """The running interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def code_files() -> list[Path]:
    """Standard-library sources, in a fixed order."""
    stdlib = stdlib_dir()
    if not stdlib.is_dir():
        return []
    return sorted(stdlib.glob("*.py")) + sorted(stdlib.glob("*/*.py"))


def license_files() -> list[Path]:
    """``/usr/share/common-licenses/*``, in a fixed order."""
    if not LICENSES.is_dir():
        return []
    return sorted(p for p in LICENSES.iterdir() if p.is_file())


def prose_files() -> list[Path]:
    """Licence texts, then Debian ``copyright`` files, in a fixed order."""
    files = license_files()
    if DOC.is_dir():
        files += sorted(DOC.glob("*/copyright"))
    return files


def read_text(path: Path) -> str | None:
    """The file's text (undecodable bytes replaced), or None when unreadable."""
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


def _split_key(path: Path) -> str:
    # Name relative to its corpus root, so the split does not depend on where Python lives.
    if path.is_relative_to(DOC):
        rel = path.relative_to(DOC).as_posix()
    elif path.is_relative_to(LICENSES):
        rel = "licenses/" + path.name
    else:
        rel = "/".join(path.parts[-2:]) if path.parent != stdlib_dir() else path.name
    return rel


def is_heldout(path: Path) -> bool:
    """Whether ``path`` belongs to the held-out slice (deterministic, by name)."""
    digest = hashlib.sha256(_split_key(path).encode()).digest()
    return int.from_bytes(digest[:8], "big") % HELDOUT_EVERY == 0


@functools.cache
def _texts(kind: Kind) -> tuple[tuple[str, ...], tuple[str, ...]]:
    files = code_files() if kind == "code" else prose_files()
    train: list[str] = []
    heldout: list[str] = []
    seen: set[str] = set()
    total = 0
    for path in files:
        text = read_text(path)
        if text is None or not text.strip():
            continue
        digest = hashlib.sha256(text.encode("utf-8", errors="replace")).hexdigest()
        if digest in seen:
            continue
        seen.add(digest)
        (heldout if is_heldout(path) else train).append(text)
        total += len(text)
        if total >= KIND_MAX_CHARS[kind]:
            break
    return tuple(train), tuple(heldout)


def corpus_texts(kind: Kind) -> list[str]:
    """The local training texts of ``kind`` (one string per file; held-out files excluded)."""
    if kind not in KINDS:
        raise ValueError(f"unknown corpus kind {kind!r}; expected one of {KINDS}")
    return list(_texts(kind)[0])


def heldout_texts(kind: Kind) -> list[str]:
    """The held-out texts of ``kind`` (never trained on; preferred for prompts)."""
    if kind not in KINDS:
        raise ValueError(f"unknown corpus kind {kind!r}; expected one of {KINDS}")
    return list(_texts(kind)[1])


def tokenizer_corpus(max_chars: int = TOKENIZER_MAX_CHARS) -> list[str]:
    """Text for tokenizer training: licences, then standard-library sources, up to ``max_chars``."""
    texts: list[str] = []
    total = 0
    stdlib = stdlib_dir()
    py = code_files() if stdlib.is_dir() else []
    for path in license_files() + py:
        text = read_text(path)
        if text is None:
            continue
        texts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    if total < 200_000:
        raise RuntimeError(
            f"not enough local text to train a tokenizer ({total} chars from "
            f"{LICENSES} and the Python standard library)"
        )
    return texts


def train_tokenizer(vocab_size: int = VOCAB_SIZE) -> Any:
    """Train the byte-level BPE ``tokenizers.Tokenizer`` on :func:`tokenizer_corpus`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tokenizer_corpus(), trainer=trainer)
    bos_id = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    return tok


# A plain chat template, so the OpenAI server's /v1/chat/completions serves the tiny models too
# (without one it answers 400).
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                 "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")


def wrap_tokenizer(tok: Any, model_max_length: int = 512) -> Any:
    """``tok`` as a ``transformers.PreTrainedTokenizerFast`` with the special tokens and a chat
    template set."""
    from transformers import PreTrainedTokenizerFast

    fast: Any = PreTrainedTokenizerFast  # untyped constructor
    return fast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=model_max_length,
        chat_template=CHAT_TEMPLATE,
    )
