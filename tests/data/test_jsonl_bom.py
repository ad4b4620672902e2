"""A JSONL or JSON-array file saved with a UTF-8 byte-order mark (as some Windows editors write it)
keeps its first row."""
from __future__ import annotations

import json

import pytest

from specforge_k25.data.sources import BadRow, iter_json_array, iter_jsonl


def test_jsonl_with_a_byte_order_mark_keeps_its_first_row(tmp_path):
    rows = [{"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}
            for i in range(3)]
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\n" for r in rows).encode())
    read = list(iter_jsonl(path))
    assert not any(isinstance(r, BadRow) for r in read)
    assert read == rows


def test_a_byte_order_mark_inside_the_file_is_still_a_bad_row(tmp_path):
    """Only the file's first character is a mark; one later is part of a line (not JSON)."""
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"a": 1}\n\xef\xbb\xbf{"a": 2}\n')
    read = list(iter_jsonl(path))
    assert read[0] == {"a": 1} and isinstance(read[1], BadRow) and read[1].reason == "malformed_json"


@pytest.mark.parametrize("chunk_chars", [1, 3, 1 << 20])
def test_json_array_with_a_byte_order_mark_keeps_its_first_item(tmp_path, chunk_chars):
    """The mark, then whitespace, then the array, read in chunks of any size (the mark alone in the first)."""
    rows = [{"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}
            for i in range(3)]
    path = tmp_path / "rows.json"
    path.write_bytes(b"\xef\xbb\xbf\n " + json.dumps(rows, indent=1).encode())
    assert list(iter_json_array(path, chunk_chars=chunk_chars)) == rows
