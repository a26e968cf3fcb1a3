"""Reading an API-key file (``--api-keys-file``, a Serve config's ``api_keys_file``): light, no FastAPI."""

from __future__ import annotations

from pathlib import Path

from ..errors import UserError

__all__ = ["read_key_file"]


def read_key_file(path: str) -> list[str]:
    """The keys in ``path``, one per line; blank lines and ``#`` comment lines are skipped."""
    try:
        lines = Path(path).read_text("utf-8").splitlines()
    except OSError as exc:
        raise UserError(f"cannot read --api-keys-file: {exc}") from None
    keys = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise UserError(f"--api-keys-file {path} holds no keys (one per line, # for comments)")
    return keys
