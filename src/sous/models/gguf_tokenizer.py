"""The tokenizer of a GGUF file, converted once and then read from a disk cache.

Converting a GGUF vocabulary into a fast tokenizer (transformers' GGUF integration) costs about
a second of start-up; the result is saved with `save_pretrained` under
`$XDG_CACHE_HOME/sous/tokenizers/<key>` (default `~/.cache/...`), where the key hashes the
file's resolved path, size and modification time and the transformers and tokenizers versions,
so a changed file or library converts afresh. `SOUS_TOKENIZER_CACHE=0` (false/no/off) turns
the cache off; another value than those or 1/true/yes/on is a ValueError naming it (`sous
serve` checks it with its flags: exit 2). A cache that cannot be written or read is skipped
with a debug log: it never stops a start.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import tokenizers
import transformers
from transformers import PreTrainedTokenizerFast

from sous.config.env_vars import TOKENIZER_CACHE_ENV, env_flag
from sous.user_cache import cache_root

logger = logging.getLogger(__name__)

CACHE_ENV = TOKENIZER_CACHE_ENV
CACHE_FORMAT = 2
"""Bumped when what a cache entry holds changes (2: `added_tokens_decoder` recorded)."""


def cache_dir(path: Path) -> Path | None:
    """Where the converted tokenizer of GGUF file `path` is cached; None when turned off."""
    if not env_flag(os.environ, CACHE_ENV, True):
        return None
    real = path.resolve()
    st = real.stat()
    ident = f"{real}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}|" \
            f"{tokenizers.__version__}|{CACHE_FORMAT}"
    key = hashlib.sha256(ident.encode()).hexdigest()[:24]
    return cache_root() / "tokenizers" / key


def convert_tokenizer(path: Path) -> Any:
    """The tokenizer the file describes, built the way `AutoTokenizer.from_pretrained(folder,
    gguf_file=...)` builds it (without re-parsing the file for a config)."""
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    arch, tok_dict, tok_config = get_gguf_tokenizer(str(path))
    backend, extra = convert_gguf_tokenizer(arch, tok_dict)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **{**tok_config, **extra})


def _save(tok: Any, where: Path) -> None:
    """Write `tok` to `where` atomically (a complete folder or none)."""
    tmp: Path | None = None
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=where.parent))
        tok.save_pretrained(str(tmp))
        _record_added_tokens(tok, tmp / "tokenizer_config.json")
        os.replace(tmp, where)
    except OSError as e:  # another process won the race, or the disk is read-only
        logger.debug("tokenizer cache not written (%s): %s", where, e)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _record_added_tokens(tok: Any, config_file: Path) -> None:
    """Write the added tokens into `tokenizer_config.json` (`added_tokens_decoder`, as
    transformers 4 saved them): without them `from_pretrained` parses all of `tokenizer.json`
    in Python again just to find those tokens (~0.1 s of every start)."""
    config = json.loads(config_file.read_text())
    config["added_tokens_decoder"] = {str(i): t.__getstate__()
                                      for i, t in tok.added_tokens_decoder.items()}
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False))


def load_tokenizer(path: Path) -> Any:
    """The GGUF file's tokenizer: from the cache when present, else converted (and cached).
    `name_or_path` is the file's folder either way."""
    where = cache_dir(path)
    tok = None
    if where is not None and (where / "tokenizer.json").is_file():
        try:
            tok = PreTrainedTokenizerFast.from_pretrained(str(where))
        except Exception as e:  # noqa: BLE001 - a broken cache entry is rebuilt
            logger.debug("tokenizer cache unreadable (%s): %s", where, e)
            shutil.rmtree(where, ignore_errors=True)
    if tok is None:
        tok = convert_tokenizer(path)
        if where is not None:
            _save(tok, where)
    tok.name_or_path = str(path.parent)
    return tok


def main(argv: list[str] | None = None) -> None:
    """`python -m sous.models.gguf_tokenizer [GGUF ...]`: convert and cache the tokenizers of
    the given files (default: the bundled model's), so that a first start finds them cached
    (`make setup` runs it)."""
    from sous.models.bundled import bundled_gguf_path

    args = sys.argv[1:] if argv is None else argv
    for name in args or [str(bundled_gguf_path())]:
        if not Path(name).is_file():
            print(f"python -m sous.models.gguf_tokenizer: {name}: no such GGUF file",
                  file=sys.stderr)
            raise SystemExit(2)
        load_tokenizer(Path(name))
        where = cache_dir(Path(name))
        cached = where is not None and (where / "tokenizer.json").is_file()
        print(f"tokenizer of {name}: {where if cached else 'not cached (cache off or unwritable)'}")


if __name__ == "__main__":
    main()
