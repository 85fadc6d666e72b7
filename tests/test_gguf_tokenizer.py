"""The GGUF tokenizer's disk cache: a cached load equals a fresh conversion, is keyed on the
file, and a broken or unwritable cache never stops a load."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sous.models import gguf_tokenizer as gt
from sous.models.bundled import bundled_gguf_path

TEXTS = ["Hello world! <|im_start|>user\nhi<|im_end|>", "  spaces\t\ttabs \n\n ünïcødé 你好 🎉",
         "<|endoftext|>x"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]


@pytest.fixture
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(gt.CACHE_ENV, raising=False)
    return tmp_path


def _same(a, b) -> None:
    for text in TEXTS:
        assert a.encode(text) == b.encode(text)
        ids = a.encode(text)
        assert a.decode(ids) == b.decode(ids)
        assert a.decode(ids, skip_special_tokens=True) == b.decode(ids, skip_special_tokens=True)
    assert (a.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
            == b.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True))
    assert a.special_tokens_map == b.special_tokens_map
    assert a.added_tokens_decoder == b.added_tokens_decoder
    assert (a.eos_token_id, a.bos_token_id, a.pad_token_id, len(a)) == \
           (b.eos_token_id, b.bos_token_id, b.pad_token_id, len(b))


def test_cached_load_equals_conversion(cache_home: Path) -> None:
    path = bundled_gguf_path()
    where = gt.cache_dir(path)
    assert where is not None and where.is_relative_to(cache_home)
    first = gt.load_tokenizer(path)  # converts and writes the cache
    assert (where / "tokenizer.json").is_file()
    second = gt.load_tokenizer(path)  # reads it
    _same(gt.convert_tokenizer(path), second)
    _same(first, second)
    assert second.name_or_path == str(path.parent)


def test_key_follows_the_file(cache_home: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(bundled_gguf_path().read_bytes())
    before = gt.cache_dir(copy)
    st = copy.stat()
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert gt.cache_dir(copy) != before
    assert gt.cache_dir(copy) != gt.cache_dir(bundled_gguf_path())


def test_broken_entry_is_rebuilt(cache_home: Path) -> None:
    path = bundled_gguf_path()
    where = gt.cache_dir(path)
    assert where is not None
    where.mkdir(parents=True)
    (where / "tokenizer.json").write_text("{not json")
    tok = gt.load_tokenizer(path)
    _same(gt.convert_tokenizer(path), tok)
    assert gt.load_tokenizer(path).encode(TEXTS[0]) == tok.encode(TEXTS[0])


def test_off_and_unwritable(cache_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = bundled_gguf_path()
    for off in ("0", "off", " False "):
        monkeypatch.setenv(gt.CACHE_ENV, off)
        assert gt.cache_dir(path) is None
    monkeypatch.setenv(gt.CACHE_ENV, "sometimes")
    with pytest.raises(ValueError, match="SOUS_TOKENIZER_CACHE='sometimes'"):
        gt.load_tokenizer(path)
    monkeypatch.setenv(gt.CACHE_ENV, "0")
    assert gt.load_tokenizer(path).encode(TEXTS[1])
    monkeypatch.delenv(gt.CACHE_ENV)
    (cache_home / "sous").write_text("a file where the cache folder would be")
    assert gt.load_tokenizer(path).encode(TEXTS[1])  # cannot cache: still loads


def test_module_caches_the_bundled_tokenizer_and_names_a_missing_file(
        cache_home: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    gt.main([])
    where = gt.cache_dir(bundled_gguf_path())
    assert where is not None and (where / "tokenizer.json").is_file()
    assert str(where) in capsys.readouterr().out
    monkeypatch.setenv(gt.CACHE_ENV, "0")
    gt.main([])
    assert "not cached" in capsys.readouterr().out
    monkeypatch.delenv(gt.CACHE_ENV)
    with pytest.raises(SystemExit) as exc:
        gt.main([str(cache_home / "missing.gguf")])
    assert exc.value.code == 2
    assert "missing.gguf: no such GGUF file" in capsys.readouterr().err
