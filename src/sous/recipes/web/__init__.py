"""The recipe page (`sous recipe page`): the vendor recipe page, served or written as files.

`bundle` precomputes, with the composer and the fit check, every composition the page can
show (each recipe, strategy, target and allowed selection of the grid); `server` serves the
page and that data over HTTP; `static/` holds the page itself (vanilla HTML, CSS and JS,
which only looks up what the bundle holds — it composes nothing).
"""
