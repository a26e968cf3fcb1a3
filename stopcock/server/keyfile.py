"""Reading an API-key file (``--api-keys-file``, a Serve config's ``api_keys_file``): light, no FastAPI."""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import UserError

__all__ = ["read_key_file"]


#: A line of a keys file: a key, then optionally a comment after white space (``KEY  # alice``).
_KEY_LINE = re.compile(r"(?P<key>[^\s#][^\s]*)(?:\s+#.*)?")


def read_key_file(path: str) -> list[str]:
    """The keys in ``path``, one per line.

    Blank lines and lines starting with ``#`` are skipped, and a key may be followed by a comment
    after white space. A line that is not that (a key with spaces inside) is refused, naming the
    line, rather than taken whole as a key.
    """
    try:
        lines = Path(path).read_text("utf-8").splitlines()
    except OSError as exc:
        raise UserError(f"cannot read --api-keys-file: {exc}") from None
    keys = []
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        found = _KEY_LINE.fullmatch(text)
        if found is None:
            raise UserError(
                f"--api-keys-file {path}, line {number}: a key cannot hold spaces; write one key per line,"
                " optionally followed by white space and a # comment"
            )
        keys.append(found["key"])
    if not keys:
        raise UserError(f"--api-keys-file {path} holds no keys (one per line, # for comments)")
    return keys
