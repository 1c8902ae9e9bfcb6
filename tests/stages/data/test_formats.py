"""Dataset loaders: plain and chat forms in JSONL/JSON/Parquet, exact located error messages, writing."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from alignflow.stages.data.formats import (
    MAX_ERRORS,
    DataError,
    Message,
    PreferenceRecord,
    PromptRecord,
    SFTRecord,
    dataset_digest,
    holdout_split,
    load_preferences,
    load_prompts,
    load_records,
    load_sft,
    render_messages_fallback,
    render_prompt,
    write_jsonl,
)

USER = {"role": "user", "content": "Write about the ocean."}
SYSTEM = {"role": "system", "content": "Be brief."}


def assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def write_lines(path: Path, lines: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def errors_of(loader, path) -> list[str]:
    with pytest.raises(DataError) as info:
        loader(path)
    assert str(info.value) == "\n".join(info.value.errors)
    return info.value.errors


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Run in tmp_path so error messages show the short relative paths a user would type."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


# --- plain forms, every file format --------------------------------------------------------------

PLAIN = {
    "sft": [
        {"prompt": "Write about the sea.\n", "completion": "The sea is calm.", "id": 1},
        {"prompt": "Hi\n", "completion": "Hello.", "id": 2},
    ],
    "preferences": [
        {"prompt": "P\n", "chosen": "good", "rejected": "bad", "id": "a"},
        {"prompt": "Q\n", "chosen": "fine", "rejected": "worse", "id": "b"},
    ],
    "prompts": [{"prompt": "Write about the sea.\n", "id": 7}, {"prompt": "Describe winter.\n", "id": 8}],
}
LOADERS = {"sft": load_sft, "preferences": load_preferences, "prompts": load_prompts}


@pytest.mark.parametrize("kind", list(PLAIN))
@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_plain_records_load_from_every_format_with_extras_kept(tmp_path, kind, suffix):
    rows = PLAIN[kind]
    path = tmp_path / f"data{suffix}"
    if suffix == ".jsonl":
        write_lines(path, [json.dumps(r) for r in rows])
    elif suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)
    records = LOADERS[kind](path)
    assert [r.model_dump(mode="json") for r in records] == rows
    assert records[0].extras == {"id": rows[0]["id"]}
    assert load_records(path, kind) == records


def test_unknown_kind_lists_valid_ones(tmp_path):
    with pytest.raises(
        ValueError, match="unknown dataset kind 'dpo'; valid kinds: sft, preferences, prompts"
    ):
        load_records(tmp_path / "x.jsonl", "dpo")


def test_blank_lines_are_skipped_and_line_numbers_stay_physical(in_tmp):
    write_lines(Path("data/p.jsonl"), ['{"prompt": "a"}', "", "   ", '{"prompt": ""}'])
    assert errors_of(load_prompts, "data/p.jsonl") == [
        "data/p.jsonl:4: field 'prompt' is empty (or only whitespace); give it text"
    ]


# --- chat forms -------------------------------------------------------------------------------------


def test_sft_messages_last_assistant_turn_becomes_the_completion(tmp_path):
    path = write_lines(
        tmp_path / "sft.jsonl", [json.dumps({"messages": [SYSTEM, USER, assistant("Waves.")], "id": 3})]
    )
    (record,) = load_sft(path)
    assert record.prompt == [Message(**SYSTEM), Message(**USER)]
    assert record.completion == "Waves."
    assert record.extras == {"id": 3}


def test_sft_multi_turn_prompt_and_completion_as_message_list(tmp_path):
    convo = [USER, assistant("Waves."), {"role": "user", "content": "More?"}, assistant("Tides.")]
    path = write_lines(
        tmp_path / "sft.jsonl",
        [json.dumps({"messages": convo}), json.dumps({"prompt": [USER], "completion": [assistant("Sea.")]})],
    )
    first, second = load_sft(path)
    assert [m.content for m in first.prompt] == ["Write about the ocean.", "Waves.", "More?"]
    assert first.completion == "Tides."
    assert second.completion == "Sea."


def test_preferences_implicit_prompt_is_the_shared_prefix(tmp_path):
    row = {
        "chosen": [SYSTEM, USER, assistant("Lovely waves.")],
        "rejected": [SYSTEM, USER, assistant("Ugly.")],
    }
    (record,) = load_preferences(write_lines(tmp_path / "p.jsonl", [json.dumps(row)]))
    assert record.prompt == [Message(**SYSTEM), Message(**USER)]
    assert (record.chosen, record.rejected) == ("Lovely waves.", "Ugly.")


def test_preferences_explicit_message_prompt_with_one_message_answers(tmp_path):
    row = {"prompt": [USER], "chosen": [assistant("Good.")], "rejected": "Bad."}
    (record,) = load_preferences(write_lines(tmp_path / "p.jsonl", [json.dumps(row)]))
    assert record.prompt == [Message(**USER)]
    assert (record.chosen, record.rejected) == ("Good.", "Bad.")


def test_prompts_from_messages(tmp_path):
    (record,) = load_prompts(write_lines(tmp_path / "p.jsonl", [json.dumps({"messages": [SYSTEM, USER]})]))
    assert record.prompt == [Message(**SYSTEM), Message(**USER)]


def test_chat_records_survive_parquet(tmp_path):
    rows = [{"messages": [USER, assistant("Waves.")]}, {"messages": [SYSTEM, USER, assistant("Sea.")]}]
    path = tmp_path / "sft.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    records = load_sft(path)
    assert [r.completion for r in records] == ["Waves.", "Sea."]
    assert [len(r.prompt) for r in records] == [1, 2]


@pytest.mark.parametrize(
    ("loader", "row", "message"),
    [
        (
            load_sft,
            {"messages": [USER]},
            "field 'messages' must end with an assistant message (it becomes the completion); "
            "last role is 'user'",
        ),
        (
            load_sft,
            {"messages": [assistant("x")]},
            "field 'messages' needs a prompt before the final assistant message",
        ),
        (
            load_sft,
            {"messages": [USER, {"role": "bot", "content": "x"}]},
            'messages[1].role must be one of system, user, assistant; got "bot"',
        ),
        (
            load_sft,
            {"messages": [USER, {"role": "assistant"}]},
            "messages[1] is missing 'content' (a message needs role and content)",
        ),
        (
            load_sft,
            {"messages": [USER, {"role": "assistant", "content": " "}]},
            "messages[1].content is empty (or only whitespace); give it text",
        ),
        (
            load_sft,
            {"messages": [USER, assistant("a")], "prompt": "x"},
            "record has both 'messages' and 'prompt'/'completion'; give one form",
        ),
        (
            load_preferences,
            {
                "chosen": [USER, assistant("a")],
                "rejected": [{"role": "user", "content": "other"}, assistant("b")],
            },
            "'chosen' and 'rejected' conversations must share the same prompt messages and differ only "
            "in the final assistant message (or give 'prompt' explicitly)",
        ),
        (
            load_preferences,
            {"prompt": [USER], "chosen": [USER, assistant("a")], "rejected": "b"},
            "field 'chosen' as a message list must hold exactly one assistant message when 'prompt' is "
            "given; got roles [user, assistant]",
        ),
        (
            load_prompts,
            {"prompt": [USER, assistant("a")]},
            "field 'prompt' must end with a user message (the turn the model answers); "
            "last role is 'assistant'",
        ),
        (
            load_prompts,
            {"messages": []},
            "field 'messages' is an empty message list; give it at least one message",
        ),
    ],
)
def test_bad_chat_records_say_what_is_wrong(in_tmp, loader, row, message):
    write_lines(Path("d.jsonl"), [json.dumps(row)])
    assert errors_of(loader, "d.jsonl") == [f"d.jsonl:1: {message}"]


# --- exact error messages ------------------------------------------------------------------------


def test_missing_field_message(in_tmp):
    write_lines(
        Path("data/prefs.jsonl"),
        [
            json.dumps({"prompt": "p", "chosen": "a", "rejected": "b"}),
            json.dumps({"prompt": "p", "chosen": "a", "rejected": "b"}),
            json.dumps({"prompt": "p", "rejected": "b"}),
        ],
    )
    assert errors_of(load_preferences, "data/prefs.jsonl") == [
        "data/prefs.jsonl:3: record is missing required field 'chosen' "
        "(preference records need prompt, chosen, rejected)"
    ]


def test_malformed_json_line_message(in_tmp):
    write_lines(Path("data/sft.jsonl"), ['{"prompt": "a", "completion": "b"}', '{"prompt" 1, 2}'])
    # What json reports for '{"prompt" 1': a missing ':' at column 11.
    assert errors_of(load_sft, "data/sft.jsonl") == [
        "data/sft.jsonl:2: malformed JSON (Expecting ':' delimiter: line 1 column 11)"
    ]
    write_lines(Path("data/sft.jsonl"), ['{"prompt":"a" "completion": "b"}'])
    assert errors_of(load_sft, "data/sft.jsonl") == [
        "data/sft.jsonl:1: malformed JSON (Expecting ',' delimiter: line 1 column 15)"
    ]


def test_empty_dataset_message(in_tmp):
    write_lines(Path("data/prompts.jsonl"), [""])
    assert errors_of(load_prompts, "data/prompts.jsonl") == [
        'data/prompts.jsonl: dataset is empty (no records); add at least one {"prompt": ...} record'
    ]
    Path("data/sft.json").write_text("[]")
    assert errors_of(load_sft, "data/sft.json") == [
        "data/sft.json: dataset is empty (no records); "
        'add at least one {"prompt": ..., "completion": ...} record'
    ]


def test_several_problems_are_reported_together_with_locations(in_tmp):
    write_lines(
        Path("p.jsonl"),
        [
            json.dumps({"prompt": "p", "chosen": "  ", "rejected": "b"}),
            json.dumps({"prompt": 5, "chosen": "a", "rejected": "b"}),
            json.dumps({"prompt": "p", "chosen": ["a"], "rejected": "b"}),
            json.dumps({"prompt": "p", "chosen": None, "rejected": "b"}),
            json.dumps(["not", "an", "object"]),
            json.dumps({"prompt": "p", "chosen": "a", "rejected": "b"}),
            json.dumps({"prompt": "p"}),
        ],
    )
    assert errors_of(load_preferences, "p.jsonl") == [
        "p.jsonl:1: field 'chosen' is empty (or only whitespace); give it text",
        "p.jsonl:2: field 'prompt' must be a string or a list of messages "
        '[{"role": ..., "content": ...}], got integer 5',
        'p.jsonl:3: chosen[0] must be an object {"role": ..., "content": ...}, got string',
        "p.jsonl:4: field 'chosen' is null; "
        "give it a value (preference records need prompt, chosen, rejected)",
        'p.jsonl:5: record must be a JSON object, got list ["not", "an", "object"]',
        "p.jsonl:7: record is missing required fields 'chosen', 'rejected' "
        "(preference records need prompt, chosen, rejected)",
    ]


def test_wrong_type_for_a_text_only_field(in_tmp):
    write_lines(Path("s.jsonl"), [json.dumps({"prompt": "p", "completion": 3.5})])
    assert errors_of(load_sft, "s.jsonl") == [
        "s.jsonl:1: field 'completion' must be a string or a list with one assistant message, got number 3.5"
    ]


def test_errors_stop_after_the_cap(in_tmp):
    write_lines(Path("p.jsonl"), ['{"id": 1}'] * (MAX_ERRORS + 15))
    errors = errors_of(load_prompts, "p.jsonl")
    assert len(errors) == MAX_ERRORS + 1
    assert errors[MAX_ERRORS - 1].startswith(
        f"p.jsonl:{MAX_ERRORS}: record is missing required field 'prompt'"
    )
    assert errors[-1] == f"p.jsonl: stopped after {MAX_ERRORS} errors; fix these and load again"


def test_json_locations_are_record_indexes(in_tmp):
    Path("d.json").write_text(json.dumps([{"prompt": "a"}, {"prompt": "b"}, {"prompt": " "}]))
    assert errors_of(load_prompts, "d.json") == [
        "d.json[2]: field 'prompt' is empty (or only whitespace); give it text"
    ]
    Path("bad.json").write_text('[{"prompt": "a"}\n {"prompt": "b"}]')
    assert errors_of(load_prompts, "bad.json") == [
        "bad.json: malformed JSON (Expecting ',' delimiter: line 2 column 2)"
    ]
    Path("obj.json").write_text('{"prompt": "a"}')
    assert errors_of(load_prompts, "obj.json") == [
        "obj.json: a .json dataset must be a list of records (a JSON array), got object; "
        "for one record per line use .jsonl"
    ]


def test_parquet_locations_are_row_indexes(in_tmp):
    pq.write_table(
        pa.Table.from_pylist(
            [
                {"prompt": "a", "completion": "x"},
                {"prompt": "b", "completion": None},
                {"prompt": "", "completion": "z"},
            ]
        ),
        "s.parquet",
    )
    assert errors_of(load_sft, "s.parquet") == [
        "s.parquet:row 1: field 'completion' is null; give it a value "
        "(SFT records need prompt, completion; or messages)",
        "s.parquet:row 2: field 'prompt' is empty (or only whitespace); give it text",
    ]


def test_unknown_suffix_and_missing_file(in_tmp):
    assert errors_of(load_sft, "data/sft.csv") == [
        "data/sft.csv: unsupported dataset format '.csv'; use one of .jsonl, .json, .parquet"
    ]
    assert errors_of(load_sft, "data/none.jsonl") == ["data/none.jsonl: dataset file not found"]
    Path("notparquet.parquet").write_text("hello")
    (message,) = errors_of(load_sft, "notparquet.parquet")
    assert message.startswith("notparquet.parquet: not a readable Parquet file")


def test_bom_crlf_and_unicode_line_separators_inside_strings(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(
        b'\xef\xbb\xbf{"prompt": "a"}\r\n' + json.dumps({"prompt": "b\u2028c"}, ensure_ascii=False).encode()
    )
    assert [r.prompt for r in load_prompts(path)] == ["a", "b\u2028c"]


def test_bad_utf8_is_reported_with_its_line_and_column(in_tmp):
    Path("d.jsonl").write_bytes(b'{"prompt": "caf\xe9"}\n')
    assert errors_of(load_prompts, "d.jsonl") == [
        "d.jsonl:1: not valid UTF-8 text (byte 0xe9 at column 16); save the file as UTF-8"
    ]
    Path("e.jsonl").write_bytes(b'{"prompt": "a"}\n\n{"prompt": "b"}\n{"prompt": "ok \xc3"}\n')
    assert errors_of(load_prompts, "e.jsonl") == [
        "e.jsonl:4: not valid UTF-8 text (byte 0xc3 at column 16); save the file as UTF-8"
    ]


def test_records_validate_when_built_in_code():
    with pytest.raises(ValueError, match="completion is empty"):
        SFTRecord(prompt="p", completion="   ")
    with pytest.raises(ValueError, match="must end with a user message"):
        PromptRecord(prompt=[Message(role="user", content="a"), Message(role="assistant", content="b")])
    with pytest.raises(ValueError):
        PreferenceRecord(prompt="p", chosen=1, rejected="b")  # strict: no int -> str coercion


# --- rendering -------------------------------------------------------------------------------------


def test_text_prompts_render_verbatim_and_messages_use_the_fallback():
    assert render_prompt("Write about the sea.\n") == "Write about the sea.\n"
    messages = [Message(**SYSTEM), Message(**USER)]
    assert render_prompt(messages) == "System:\nBe brief.\nUser:\nWrite about the ocean.\nAssistant:\n"
    assert render_messages_fallback(messages, add_generation_prompt=False) == (
        "System:\nBe brief.\nUser:\nWrite about the ocean.\n"
    )


class _TemplateTokenizer:
    chat_template = "{{ messages }}"

    def apply_chat_template(self, conversation, tokenize=True, add_generation_prompt=False):
        assert tokenize is False and add_generation_prompt is True
        return "|".join(f"{m['role']}={m['content']}" for m in conversation) + "|assistant="


def test_messages_use_the_tokenizer_chat_template_when_there_is_one():
    messages = [Message(**USER)]
    assert render_prompt(messages, _TemplateTokenizer()) == "user=Write about the ocean.|assistant="
    no_template = _TemplateTokenizer()
    no_template.chat_template = None
    assert render_prompt(messages, no_template) == render_prompt(messages)


# --- writing and digests ---------------------------------------------------------------------------


def test_write_jsonl_round_trips_every_kind(tmp_path):
    records = [
        SFTRecord(prompt=[Message(**USER)], completion="Waves.", id=1),
        SFTRecord(prompt="Describe winter.\n", completion="Snow.", topic="winter"),
    ]
    path = write_jsonl(records, tmp_path / "out" / "sft.jsonl")
    assert load_sft(path) == records
    assert path.read_text().splitlines()[0] == (
        '{"prompt": [{"role": "user", "content": "Write about the ocean."}], "completion": "Waves.", "id": 1}'
    )
    prefs = [PreferenceRecord(prompt="p", chosen="é ☕", rejected="b")]
    assert load_preferences(write_jsonl(prefs, tmp_path / "p.jsonl")) == prefs


def test_write_jsonl_is_atomic(tmp_path):
    path = write_jsonl([{"prompt": "old"}], tmp_path / "p.jsonl")
    before = path.read_bytes()

    def records():
        yield {"prompt": "new"}
        raise RuntimeError("writer died halfway")

    with pytest.raises(RuntimeError, match="halfway"):
        write_jsonl(records(), path)
    assert path.read_bytes() == before  # the old file is untouched ...
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.jsonl"]  # ... and no temp file is left behind


def test_dataset_digest_is_sha256_of_the_bytes(tmp_path):
    path = write_jsonl([{"prompt": "a"}], tmp_path / "p.jsonl")
    assert dataset_digest(path) == hashlib.sha256(path.read_bytes()).hexdigest()
    first = dataset_digest(path)
    write_jsonl([{"prompt": "b"}], path)
    assert dataset_digest(path) != first


def test_holdout_split_is_deterministic_disjoint_and_sized():
    records = [PromptRecord(prompt=f"p{i}") for i in range(200)]
    train, held = holdout_split(records, 0.05, seed=3)
    assert len(held) == 10 and len(train) == 190
    assert {r.prompt for r in train}.isdisjoint({r.prompt for r in held})
    assert holdout_split(records, 0.05, seed=3) == (train, held)
    assert holdout_split(records, 0.05, seed=4)[1] != held
    with pytest.raises(ValueError, match=r"fraction must be in \(0, 1\), got 1.5"):
        holdout_split(records, 1.5)
