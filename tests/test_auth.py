"""The API keys file: pairs, comments, and a malformed line named; loopback hosts."""

from __future__ import annotations

from pathlib import Path

import pytest

from api.auth import KeysFileError, is_loopback, load_keys


def test_keys_file(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("# comment\n\nk1 alice\n  k2\tbob   # trailing comment\n")
    assert load_keys(f) == {"k1": "alice", "k2": "bob"}
    f.write_text("k1 alice\nk2 bob extra\n")
    with pytest.raises(KeysFileError, match=r"keys:2: expected 'KEY TENANT'"):
        load_keys(f)
    f.write_text("k1 alice\nk1 bob\n")
    with pytest.raises(KeysFileError, match=r"keys:2: .*given before"):
        load_keys(f)
    f.write_text("# nothing\n")
    with pytest.raises(KeysFileError, match="no 'KEY TENANT'"):
        load_keys(f)
    with pytest.raises(KeysFileError, match="cannot read"):
        load_keys(tmp_path / "missing")


def test_loopback() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.org")
