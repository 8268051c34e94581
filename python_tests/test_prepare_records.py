"""Property test of the prepare-data record parser (issue 19): any line, arbitrary JSON or bytes that are not UTF-8,
becomes either a document whose tokens and loss mask agree with its record, or a ValueError that names the file and
the line, never another exception."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from peagle.train.data import record_documents
from testkit import tiny_tokenizer

KEYS = ["messages", "conversations", "conversation", "text", "prompt_ids", "completion_ids", "role", "content",
        "from", "value"]  # fmt: skip
ROLES = ["user", "assistant", "system", "human", "gpt", "tool", ""]

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_subnormal=False)
    | st.text(max_size=12)
)
words = st.lists(st.sampled_from(["w1", "w2", "w30", "hello", "<|end|>", "<s>"]), max_size=6).map(" ".join)
json_values = st.recursive(
    scalars | words,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=16,
)
turn = st.fixed_dictionaries(
    {"role": st.sampled_from(ROLES) | json_values, "content": words | json_values}
) | st.fixed_dictionaries({"from": st.sampled_from(ROLES), "value": words})
token_ids = st.lists(st.integers(-3, 80) | json_values, max_size=6)
records = (
    st.builds(
        lambda key, turns: {key: turns},
        st.sampled_from(["messages", "conversations"]),
        st.lists(turn, max_size=4) | json_values,
    )
    | st.fixed_dictionaries({"text": words | json_values})
    | st.fixed_dictionaries({"completion_ids": token_ids}, optional={"prompt_ids": token_ids})
    | st.fixed_dictionaries({"prompt_ids": token_ids})
)
lines = st.lists(
    records.map(lambda r: json.dumps(r).encode())
    | json_values.map(lambda v: json.dumps(v).encode())
    | st.binary(max_size=12).filter(lambda b: b"\n" not in b and b"\r" not in b),
    min_size=1,
    max_size=5,
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=lines)
@example(content=[b"\x1c", b'{"text":""}'])  # a control character alone is not a blank line (str.strip drops it)
def test_any_line_is_a_document_or_an_error_naming_its_line(tokenizer, tmp_path, content):
    source = Path(tmp_path) / "data.jsonl"
    source.write_bytes(b"\n".join(content) + b"\n")
    numbered = [n for n, line in enumerate(content, 1) if line.strip()]
    seen: list[int] = []
    error = None
    try:
        for location, record, document in record_documents(str(source), tokenizer):
            path, _, number = location.rpartition(":")
            assert path == str(source)
            seen.append(int(number))
            check_document(record, document, len(tokenizer))
    except ValueError as err:
        error = str(err)
    # Records come out in line order; blank lines are skipped; parsing stops at the first bad line, named.
    assert seen == numbered[: len(seen)]
    if error is not None:
        bad = numbered[len(seen)]
        assert error.startswith(f"{source}:{bad}: "), error
        assert "\n" not in error
    else:
        assert seen == numbered
        for number in seen:
            value = json.loads(content[number - 1])
            assert isinstance(value, dict), "a line that is not a JSON object must be refused"


def check_document(record: dict, document, vocab: int) -> None:
    assert isinstance(record, dict)
    assert len(document.ids) == len(document.loss)
    assert all(isinstance(t, int) and 0 <= t < vocab for t in document.ids)
    if "completion_ids" in record:
        prompt, completion = record.get("prompt_ids", []), record["completion_ids"]
        assert document.ids == prompt + completion
        assert document.loss == [False] * len(prompt) + [True] * len(completion)
    elif "text" in record and not any(k in record for k in ("messages", "conversations", "conversation")):
        assert isinstance(record["text"], str) and all(document.loss)
    else:
        turns = next(record[k] for k in ("messages", "conversations", "conversation") if k in record)
        assert isinstance(turns, list)
        if any(document.loss):
            roles = [t.get("role", t.get("from")) for t in turns]
            assert "assistant" in roles or "gpt" in roles
