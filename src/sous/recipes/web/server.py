"""Serving the recipe page (stdlib `http.server`) and writing it as static files.

Routes: `/` and `/index.html` (the page), `/page.css`, `/i18n.js`, `/page.js`, `/views.js`
(from `static/`), `/data.js` (the bundle as a script, as in the static output) and `/data.json`
(the bundle as JSON). Anything else is 404; only GET and HEAD are answered. The bundle is
built once, when the server is made; the server owns its bytes and never changes them.

`write_static(out_dir, recipes)` writes the same files (not `data.json`) into a folder; its
`index.html` opens from disk (file://) without a server: the data is a script, not a fetch.

Public API: `STATIC_FILES`, `static_dir`, `make_server`, `write_static`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path

from sous.recipes.catalog import LoadedRecipe
from sous.recipes.web.bundle import build_bundle, bundle_js

__all__ = ["STATIC_FILES", "make_server", "static_dir", "write_static"]

STATIC_FILES = {"index.html": "text/html", "page.css": "text/css", "i18n.js": "text/javascript",
                "page.js": "text/javascript", "views.js": "text/javascript"}
"""The page's own files (under `static/`) and their content types."""


def static_dir() -> Path:
    """The folder of the page's own files."""
    return Path(str(resources.files("sous.recipes.web") / "static"))


def _files(recipes: Sequence[LoadedRecipe], json_too: bool) -> dict[str, tuple[bytes, str]]:
    """Every file of the page: name -> (bytes, content type); `data.json` if `json_too`."""
    out = {name: ((static_dir() / name).read_bytes(), ctype)
           for name, ctype in STATIC_FILES.items()}
    bundle = build_bundle(recipes)
    out["data.js"] = (bundle_js(bundle).encode(), "text/javascript")
    if json_too:
        out["data.json"] = (json.dumps(bundle, ensure_ascii=False).encode(), "application/json")
    return out


def write_static(out_dir: str | Path, recipes: Sequence[LoadedRecipe]) -> list[Path]:
    """Write the page and its precomputed data into `out_dir` (created if missing);
    returns the written paths. Files of the same names are replaced, others kept."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (body, _) in _files(recipes, json_too=False).items():
        path = out / name
        path.write_bytes(body)
        written.append(path)
    return written


class _Handler(BaseHTTPRequestHandler):
    """Answers from `files` (name -> (bytes, content type)); quiet unless `log` is set."""

    server_version = "sous-recipe-page"

    def __init__(self, *args, files: dict[str, tuple[bytes, str]], log: bool, **kwargs):
        self.files, self.log = files, log
        super().__init__(*args, **kwargs)

    def _answer(self, with_body: bool) -> None:
        name = self.path.split("?", 1)[0].split("#", 1)[0].lstrip("/") or "index.html"
        if name not in self.files:
            self.send_error(404, "not found")
            return
        body, ctype = self.files[name]
        self.send_response(200)
        self.send_header("Content-Type", f"{ctype}; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        if with_body:
            self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self._answer(True)

    def do_HEAD(self) -> None:  # noqa: N802 - http.server's name
        self._answer(False)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the base's signature
        if self.log:
            super().log_message(format, *args)


def make_server(recipes: Sequence[LoadedRecipe], host: str = "127.0.0.1", port: int = 8080,
                log: bool = False) -> ThreadingHTTPServer:
    """A bound (not yet serving) server of the page; port 0 picks a free port (see
    `server.server_address`). The caller runs `serve_forever()` and `server_close()`."""
    handler = partial(_Handler, files=_files(recipes, json_too=True), log=log)
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server
