"""Dataset files -> validated records: SFT, preference and prompt sets in JSONL, JSON or Parquet.

What this is: the only reader and writer of the pipeline's dataset files. It turns a file into a list
of pydantic records, accepting the plain form and the chat ("messages") form, and reports every bad
record with its FILE and LINE (JSONL: 1-based line; JSON: 0-based record index as `file[3]`;
Parquet: 0-based row as `file:row 3`). Given `SizeLimits` (data.max_file_mb, data.max_record_kb), it
refuses a file over the limit before reading it, and a record over the limit (a JSONL line before it is
parsed), so a crafted file cannot make a stage hold gigabytes. What it is not: it does not tokenize, split
or store data.

Record forms accepted (extra keys such as "id" are kept on the record):

    SFT          {"prompt": P, "completion": str}
                 {"messages": [..., {"role": "assistant", "content": str}]}   last message = completion
    preference   {"prompt": P, "chosen": C, "rejected": C}                    C = str or [assistant msg]
                 {"chosen": [msgs...], "rejected": [msgs...]}                  shared prefix = prompt
    prompt       {"prompt": P}
                 {"messages": [..., {"role": "user", ...}]}

where P is a string or a list of messages [{"role": "system"|"user"|"assistant", "content": str}]
ending with a user message. `render_prompt` turns P into model text.

Text prompts are used verbatim: the completion is appended right after the prompt, so a text prompt
should end with its own separator (the demo task ends every prompt with a newline). A newline is also
the boundary byte-level BPE never merges across, so the prompt's tokens stay a prefix of the
prompt+completion tokens; the chat rendering below ends with a newline for the same reason.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, field_validator

Kind = Literal["sft", "preferences", "prompts"]
SUFFIXES: tuple[str, ...] = (".jsonl", ".json", ".parquet")
ROLES: tuple[str, ...] = ("system", "user", "assistant")
MAX_ERRORS = 20  # errors collected before a load gives up: enough to show a pattern, short enough to read


@dataclass(frozen=True)
class SizeLimits:
    """The largest file (MiB) and record (KiB) a load reads: data.max_file_mb and data.max_record_kb for the
    user's files. None: no limit (the pipeline's own files, written after the data stage checked them)."""

    max_file_mb: int | None = None
    max_record_kb: int | None = None

    @property
    def record_bytes(self) -> int | None:
        return None if self.max_record_kb is None else self.max_record_kb * 1024


class DataError(ValueError):
    """A dataset that cannot be used. `errors` holds one 'FILE:LINE: problem' line per problem."""

    def __init__(self, errors: Sequence[str]):
        self.errors = list(errors)
        super().__init__("\n".join(self.errors))


# ---------------------------------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------------------------------


def _require_text(value: str, what: str = "text") -> str:
    if not value.strip():
        raise ValueError(f"{what} is empty (or only whitespace)")
    return value


class Message(BaseModel):
    """One chat turn."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    role: Literal["system", "user", "assistant"]
    content: str

    @field_validator("content")
    @classmethod
    def _content_not_blank(cls, value: str) -> str:
        return _require_text(value, "content")


Prompt = str | list[Message]


class _Record(BaseModel):
    """Fields shared by every record; unknown keys (e.g. "id", "topic") are kept as extras."""

    model_config = ConfigDict(extra="allow", strict=True)

    prompt: str | list[Message]

    @field_validator("prompt")
    @classmethod
    def _prompt_ok(cls, value: Prompt) -> Prompt:
        if isinstance(value, str):
            return _require_text(value, "prompt")
        if not value:
            raise ValueError("prompt message list is empty")
        if value[-1].role != "user":
            raise ValueError(f"a prompt conversation must end with a user message, not '{value[-1].role}'")
        return value

    @property
    def extras(self) -> dict[str, Any]:
        """The extra keys of the source record (e.g. {"id": 7})."""
        return dict(self.model_extra or {})


class SFTRecord(_Record):
    """A supervised example: the model learns to write `completion` after `prompt`."""

    completion: str

    @field_validator("completion")
    @classmethod
    def _completion_ok(cls, value: str) -> str:
        return _require_text(value, "completion")


class PreferenceRecord(_Record):
    """A preference pair: for `prompt`, `chosen` is preferred over `rejected`."""

    chosen: str
    rejected: str

    @field_validator("chosen", "rejected")
    @classmethod
    def _answer_ok(cls, value: str) -> str:
        return _require_text(value, "answer")


class PromptRecord(_Record):
    """A prompt for RL rollouts or evaluation."""


Record = SFTRecord | PreferenceRecord | PromptRecord
R = TypeVar("R", SFTRecord, PreferenceRecord, PromptRecord)


# ---------------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------------


class _ChatTokenizer(Protocol):
    chat_template: str | None

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


def render_messages_fallback(messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
    """The chat format used when no tokenizer chat template is given.

    Each turn is "<Role>:\\n<content>\\n" (Role capitalised); the generation prompt is "Assistant:\\n".
    Example: [user "Hi"] -> "User:\\nHi\\nAssistant:\\n". The tiny tokenizer's chat template
    (stages/common/models/tiny.py) renders exactly this, so both paths give the same text.
    """
    text = "".join(f"{m.role.capitalize()}:\n{m.content}\n" for m in messages)
    return text + ("Assistant:\n" if add_generation_prompt else "")


def render_prompt(prompt: Prompt, tokenizer: _ChatTokenizer | None = None) -> str:
    """Model text for a prompt: a text prompt verbatim; messages through the tokenizer's chat template.

    Messages use `tokenizer.apply_chat_template(..., add_generation_prompt=True)` when the tokenizer
    has a chat template, else `render_messages_fallback`. The completion is appended right after.
    """
    if isinstance(prompt, str):
        return prompt
    messages = [m if isinstance(m, Message) else Message.model_validate(m) for m in prompt]
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(
            [m.model_dump() for m in messages], tokenize=False, add_generation_prompt=True
        )
        if not isinstance(rendered, str):
            raise TypeError(
                f"apply_chat_template(tokenize=False) returned {type(rendered).__name__}, not str"
            )
        return rendered
    return render_messages_fallback(messages)


# ---------------------------------------------------------------------------------------------------
# Raw dict -> canonical fields (the checks behind every error message)
# ---------------------------------------------------------------------------------------------------

_NEEDS = {
    "sft": "SFT records need prompt, completion; or messages",
    "preferences": "preference records need prompt, chosen, rejected",
    "prompts": "prompt records need prompt; or messages",
}
_EXAMPLE = {
    "sft": '{"prompt": ..., "completion": ...}',
    "preferences": '{"prompt": ..., "chosen": ..., "rejected": ...}',
    "prompts": '{"prompt": ...}',
}
_MODELS: dict[str, type[_Record]] = {
    "sft": SFTRecord,
    "preferences": PreferenceRecord,
    "prompts": PromptRecord,
}


class _Invalid(Exception):
    """One problem with one record (the message has no location; the loader adds it)."""


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    return {
        dict: "object",
        list: "list",
        str: "string",
        bool: "boolean",
        int: "integer",
        float: "number",
    }.get(type(value), type(value).__name__)


def _shown(value: Any) -> str:
    text = json.dumps(value, default=str, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."


def _text_field(record: dict[str, Any], key: str) -> str:
    value = record[key]
    if not isinstance(value, str):
        raise _Invalid(f"field '{key}' must be a string, got {_type_name(value)} {_shown(value)}")
    if not value.strip():
        raise _Invalid(f"field '{key}' is empty (or only whitespace); give it text")
    return value


def _messages_field(value: Any, key: str) -> list[Message]:
    if not isinstance(value, list):
        raise _Invalid(
            f"field '{key}' must be a list of messages "
            f'[{{"role": ..., "content": ...}}], got {_type_name(value)} {_shown(value)}'
        )
    if not value:
        raise _Invalid(f"field '{key}' is an empty message list; give it at least one message")
    messages = []
    for i, item in enumerate(value):
        where = f"{key}[{i}]"
        if not isinstance(item, dict):
            raise _Invalid(
                f'{where} must be an object {{"role": ..., "content": ...}}, got {_type_name(item)}'
            )
        missing = [k for k in ("role", "content") if k not in item or item[k] is None]
        if missing:
            raise _Invalid(f"{where} is missing '{missing[0]}' (a message needs role and content)")
        extra = sorted(set(item) - {"role", "content"})
        if extra:
            raise _Invalid(f"{where} has unknown key '{extra[0]}' (a message has only role and content)")
        role, content = item["role"], item["content"]
        if role not in ROLES:
            raise _Invalid(f"{where}.role must be one of {', '.join(ROLES)}; got {_shown(role)}")
        if not isinstance(content, str):
            raise _Invalid(f"{where}.content must be a string, got {_type_name(content)} {_shown(content)}")
        if not content.strip():
            raise _Invalid(f"{where}.content is empty (or only whitespace); give it text")
        messages.append(Message(role=role, content=content))
    return messages


def _prompt_value(value: Any, key: str) -> Prompt:
    if isinstance(value, str):
        if not value.strip():
            raise _Invalid(f"field '{key}' is empty (or only whitespace); give it text")
        return value
    if isinstance(value, list):
        messages = _messages_field(value, key)
        _check_prompt_messages(messages, key)
        return messages
    raise _Invalid(
        f"field '{key}' must be a string or a list of messages "
        f'[{{"role": ..., "content": ...}}], got {_type_name(value)} {_shown(value)}'
    )


def _check_prompt_messages(messages: list[Message], key: str) -> None:
    if messages[-1].role != "user":
        raise _Invalid(
            f"field '{key}' must end with a user message (the turn the model answers); "
            f"last role is '{messages[-1].role}'"
        )


def _answer_value(value: Any, key: str) -> str:
    """A completion/chosen/rejected value: text, or a list holding one assistant message."""
    if isinstance(value, str):
        if not value.strip():
            raise _Invalid(f"field '{key}' is empty (or only whitespace); give it text")
        return value
    if isinstance(value, list):
        messages = _messages_field(value, key)
        if len(messages) != 1 or messages[0].role != "assistant":
            roles = ", ".join(m.role for m in messages)
            raise _Invalid(
                f"field '{key}' as a message list must hold exactly one assistant message "
                f"when 'prompt' is given; got roles [{roles}]"
            )
        return messages[0].content
    raise _Invalid(
        f"field '{key}' must be a string or a list with one assistant message, "
        f"got {_type_name(value)} {_shown(value)}"
    )


def _missing(record: dict[str, Any], keys: Sequence[str], kind: Kind, nulls: set[str]) -> None:
    for key in keys:
        if key in nulls:
            raise _Invalid(f"field '{key}' is null; give it a value ({_NEEDS[kind]})")
    absent = [k for k in keys if k not in record]
    if len(absent) == 1:
        raise _Invalid(f"record is missing required field '{absent[0]}' ({_NEEDS[kind]})")
    if absent:
        names = ", ".join(f"'{k}'" for k in absent)
        raise _Invalid(f"record is missing required fields {names} ({_NEEDS[kind]})")


def _canonical(record: Any, kind: Kind) -> dict[str, Any]:
    """Check one raw record and return its canonical fields (plus extras); raise _Invalid."""
    if not isinstance(record, dict):
        raise _Invalid(f"record must be a JSON object, got {_type_name(record)} {_shown(record)}")
    # Parquet gives every row every column, so a null means "absent"; a null in a field the record
    # needs is reported as null rather than missing.
    nulls = {k for k, v in record.items() if v is None}
    record = {k: v for k, v in record.items() if v is not None}
    out: dict[str, Any]
    if kind == "sft":
        if "messages" in record:
            if "prompt" in record or "completion" in record:
                raise _Invalid("record has both 'messages' and 'prompt'/'completion'; give one form")
            messages = _messages_field(record.pop("messages"), "messages")
            if messages[-1].role != "assistant":
                raise _Invalid(
                    "field 'messages' must end with an assistant message (it becomes the completion); "
                    f"last role is '{messages[-1].role}'"
                )
            if len(messages) < 2:
                raise _Invalid("field 'messages' needs a prompt before the final assistant message")
            _check_prompt_messages(messages[:-1], "messages[:-1]")
            out = {"prompt": messages[:-1], "completion": messages[-1].content}
        else:
            _missing(record, ("prompt", "completion"), kind, nulls)
            out = {
                "prompt": _prompt_value(record.pop("prompt"), "prompt"),
                "completion": _answer_value(record.pop("completion"), "completion"),
            }
    elif kind == "preferences":
        implicit = "prompt" not in record and isinstance(record.get("chosen"), list)
        if implicit:
            _missing(record, ("chosen", "rejected"), kind, nulls)
            chosen = _messages_field(record.pop("chosen"), "chosen")
            rejected = _messages_field(record.pop("rejected"), "rejected")
            for key, conv in (("chosen", chosen), ("rejected", rejected)):
                if conv[-1].role != "assistant" or len(conv) < 2:
                    raise _Invalid(
                        f"field '{key}' without a 'prompt' must be a conversation ending with the "
                        "assistant's answer, after at least one prompt message"
                    )
            if chosen[:-1] != rejected[:-1]:
                raise _Invalid(
                    "'chosen' and 'rejected' conversations must share the same prompt messages and "
                    "differ only in the final assistant message (or give 'prompt' explicitly)"
                )
            _check_prompt_messages(chosen[:-1], "chosen[:-1]")
            out = {"prompt": chosen[:-1], "chosen": chosen[-1].content, "rejected": rejected[-1].content}
        else:
            _missing(record, ("prompt", "chosen", "rejected"), kind, nulls)
            out = {
                "prompt": _prompt_value(record.pop("prompt"), "prompt"),
                "chosen": _answer_value(record.pop("chosen"), "chosen"),
                "rejected": _answer_value(record.pop("rejected"), "rejected"),
            }
    else:
        if "messages" in record:
            if "prompt" in record:
                raise _Invalid("record has both 'messages' and 'prompt'; give one form")
            messages = _messages_field(record.pop("messages"), "messages")
            _check_prompt_messages(messages, "messages")
            out = {"prompt": messages}
        else:
            _missing(record, ("prompt",), kind, nulls)
            out = {"prompt": _prompt_value(record.pop("prompt"), "prompt")}
    out.update(record)  # extras ("id", "topic", ...) ride along
    return out


# ---------------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------------


def _check_suffix(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise DataError(
            [
                f"{path}: unsupported dataset format '{path.suffix or '(no suffix)'}'; "
                f"use one of {', '.join(SUFFIXES)}"
            ]
        )
    return suffix


def _not_utf8(path: Path, raw: bytes, exc: UnicodeDecodeError) -> str:
    """'FILE:LINE: ...' for the first byte that is not UTF-8 (the line and the byte's column in it)."""
    line = raw.count(b"\n", 0, exc.start) + 1
    column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
    return (
        f"{path}:{line}: not valid UTF-8 text (byte 0x{raw[exc.start]:02x} at column {column}); "
        "save the file as UTF-8"
    )


def _over_record_limit(size: int, limits: SizeLimits) -> _Invalid:
    return _Invalid(
        f"record is {size / 1024:,.0f} KiB, over data.max_record_kb={limits.max_record_kb}; "
        "shorten it or raise data.max_record_kb"
    )


def _held_to(record: Any, limits: SizeLimits) -> Any:
    """A parsed JSON or Parquet record, or _Invalid when it is longer than the limit written back as JSON."""
    if limits.record_bytes is None:
        return record
    size = len(json.dumps(record, ensure_ascii=False, default=str).encode("utf-8"))
    return _over_record_limit(size, limits) if size > limits.record_bytes else record


def _raw_records(path: Path, suffix: str, limits: SizeLimits) -> Iterator[tuple[str, Any]]:
    """Yield (location, raw record or _Invalid) for every record in the file."""
    most = limits.record_bytes
    if suffix == ".jsonl":
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8-sig")  # -sig: a leading BOM (Windows editors) is not data
        except UnicodeDecodeError as exc:
            raise DataError([_not_utf8(path, raw, exc)]) from None
        # Split on "\n" only: str.splitlines() would also split on U+2028, which JSON allows inside strings.
        for number, line in enumerate(text.split("\n"), start=1):
            if not line.strip():
                continue  # blank lines (e.g. a trailing one) are not records
            # a UTF-8 character is 1-4 bytes: only a line longer than most / 4 characters can be over
            if most is not None and len(line) > most // 4 and len(line.encode("utf-8")) > most:
                yield f"{path}:{number}", _over_record_limit(len(line.encode("utf-8")), limits)
                continue  # not parsed
            try:
                yield f"{path}:{number}", json.loads(line)
            except json.JSONDecodeError as exc:
                yield f"{path}:{number}", _Invalid(f"malformed JSON ({exc.msg}: line 1 column {exc.colno})")
    elif suffix == ".json":
        raw = path.read_bytes()
        try:
            data = json.loads(raw.decode("utf-8-sig"))
        except UnicodeDecodeError as exc:
            raise DataError([_not_utf8(path, raw, exc)]) from None
        except json.JSONDecodeError as exc:
            raise DataError(
                [f"{path}: malformed JSON ({exc.msg}: line {exc.lineno} column {exc.colno})"]
            ) from None
        if not isinstance(data, list):
            raise DataError(
                [
                    f"{path}: a .json dataset must be a list of records (a JSON array), "
                    f"got {_type_name(data)}; "
                    "for one record per line use .jsonl"
                ]
            )
        for index, item in enumerate(data):
            yield f"{path}[{index}]", _held_to(item, limits)
    else:
        import pyarrow.parquet as pq  # only Parquet readers pay for the import

        try:
            table = pq.read_table(path)
        except Exception as exc:  # pyarrow raises several types for a bad file; all mean the same here
            raise DataError([f"{path}: not a readable Parquet file ({exc})"]) from None
        for index, row in enumerate(table.to_pylist()):
            yield f"{path}:row {index}", _held_to(row, limits)


def _load(
    path: str | os.PathLike[str], kind: Kind, limits: SizeLimits | None = None, max_errors: int = MAX_ERRORS
) -> list[Any]:
    path = Path(path)
    limits = limits or SizeLimits()
    suffix = _check_suffix(path)
    if not path.is_file():
        raise DataError(
            [f"{path}: dataset file not found" + (" (it is a directory)" if path.is_dir() else "")]
        )
    size = path.stat().st_size
    if limits.max_file_mb is not None and size > limits.max_file_mb * 1024 * 1024:
        raise DataError(
            [
                f"{path}: {size / 1024 / 1024:,.1f} MiB, over data.max_file_mb={limits.max_file_mb}; "
                "split the file or raise data.max_file_mb"
            ]
        )
    model = _MODELS[kind]
    records: list[Any] = []
    errors: list[str] = []
    for where, raw in _raw_records(path, suffix, limits):
        try:
            if isinstance(raw, _Invalid):
                raise raw
            records.append(model.model_validate(_canonical(raw, kind)))
        except _Invalid as exc:
            errors.append(f"{where}: {exc}")
        except ValueError as exc:  # pydantic's backstop; the checks above should have caught it first
            errors.append(f"{where}: invalid record ({exc})")
        if len(errors) >= max_errors:
            errors.append(f"{path}: stopped after {max_errors} errors; fix these and load again")
            break
    if errors:
        raise DataError(errors)
    if not records:
        raise DataError([f"{path}: dataset is empty (no records); add at least one {_EXAMPLE[kind]} record"])
    return records


def load_sft(path: str | os.PathLike[str], limits: SizeLimits | None = None) -> list[SFTRecord]:
    """SFT records from a .jsonl/.json/.parquet file; raises DataError listing up to 20 problems."""
    return _load(path, "sft", limits)


def load_preferences(
    path: str | os.PathLike[str], limits: SizeLimits | None = None
) -> list[PreferenceRecord]:
    """Preference records from a .jsonl/.json/.parquet file; raises DataError listing up to 20 problems."""
    return _load(path, "preferences", limits)


def load_prompts(path: str | os.PathLike[str], limits: SizeLimits | None = None) -> list[PromptRecord]:
    """Prompt records from a .jsonl/.json/.parquet file; raises DataError listing up to 20 problems."""
    return _load(path, "prompts", limits)


def load_records(path: str | os.PathLike[str], kind: Kind, limits: SizeLimits | None = None) -> list[Any]:
    """Records of `kind` ('sft' | 'preferences' | 'prompts'); an unknown kind lists the valid ones."""
    if kind not in _MODELS:
        raise ValueError(f"unknown dataset kind {kind!r}; valid kinds: {', '.join(_MODELS)}")
    return _load(path, kind, limits)


def _record_dict(record: BaseModel | dict[str, Any]) -> dict[str, Any]:
    """The JSON form of a record (canonical fields first, then extras)."""
    if isinstance(record, BaseModel):
        return record.model_dump(mode="json")
    return dict(record)


def write_jsonl(records: Iterable[BaseModel | dict[str, Any]], path: str | os.PathLike[str]) -> Path:
    """Write records as JSONL atomically (temp file in the same folder, fsync, os.replace); returns path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as fh:
            for record in records:
                fh.write(json.dumps(_record_dict(record), ensure_ascii=False) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def dataset_digest(path: str | os.PathLike[str]) -> str:
    """sha256 (hex) of the file's bytes: the identity of a dataset in manifests."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def holdout_split(records: Sequence[R], fraction: float, seed: int = 0) -> tuple[list[R], list[R]]:
    """Deterministic (train, held_out) split; held_out has round(fraction * n) records, at least 1.

    The shuffle is random.Random(seed), so the same file and seed always give the same split.
    """
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"holdout fraction must be in (0, 1), got {fraction}")
    if len(records) < 2:
        raise ValueError(f"need at least 2 records to hold some out, got {len(records)}")
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    n_held = min(len(records) - 1, max(1, round(fraction * len(records))))
    held = set(order[:n_held])
    train = [r for i, r in enumerate(records) if i not in held]
    return train, [r for i, r in enumerate(records) if i in held]
