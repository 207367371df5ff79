"""mkdocs hook: the ``<!-- recipe-keys -->`` marker of a page becomes a table of every
recipe key (``tandem.trainers.recipe_keys``), so the training guide lists exactly the keys
the code accepts, with their help."""

from __future__ import annotations

MARKER = "<!-- recipe-keys -->"


def on_page_markdown(markdown: str, **_: object) -> str:
    """Replace the marker with the table (pages without it pass unchanged)."""
    if MARKER not in markdown:
        return markdown
    from tandem.trainers.recipe_keys import recipe_keys

    rows = ["| key | type | default | what it does |", "|---|---|---|---|"]
    for key in recipe_keys():
        cells = [f"`{key.key}`", f"`{key.type}`", f"`{key.default!r}`", key.help]
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return markdown.replace(MARKER, "\n".join(rows))
