"""Secrets in URLs kept out of what ftctl prints, writes and logs.

An inventory URL may carry a secret: a password or a token as the user name
(`http://user:secret@host`, `https://TOKEN@host`) or a token in the query
(`?token=`, `?api_key=`, `?X-Amz-Signature=`). Requests still go out with it;
every output shows `***` in its place: `output.py`'s renderers (tables, text,
`--json`, errors and warnings), drill reports, the canary daemon's `/workers`,
and the log records of the long-running services (`install_log_redaction`).

`redact_url` masks one URL; `redact_text` masks every URL inside free text (an
error message, a log line). Both return their input unchanged when it holds no
secret, and text without `://` costs one substring search.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit, urlunsplit

__all__ = ["MASK", "install_log_redaction", "redact_text", "redact_url"]

MASK = "***"

# Patterns as strings, compiled on first use (re caches them): the one-shot probe imports
# this module and rarely prints a URL.
# A URL in free text: a scheme, `://`, then up to whitespace, a quote, a parenthesis or
# a brace (what repr() and messages put around a URL; brackets belong to IPv6 hosts).
_URL = r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>(){}`]+"
# A query or fragment parameter whose value is a secret: its name, or the last word
# of it (`access_token`, `X-Amz-Signature`, `apiKey`), is one of these.
_SECRET_WORDS = frozenset({
    "token", "secret", "password", "passwd", "pwd", "pass", "key", "apikey", "auth",
    "authorization", "sig", "signature", "credential", "credentials", "session", "jwt",
    "bearer",
})
_WORD = r"[a-z0-9]+"
_PARAM = r"(^|[&;])([^=&;]*)=([^&;]*)"


def _is_secret_name(name: str) -> bool:
    lowered = name.lower()
    words = re.findall(_WORD, lowered)
    if not words:
        return False
    last = words[-1]
    return last in _SECRET_WORDS or lowered.endswith(("token", "secret", "password", "apikey"))


def _redact_params(text: str) -> str:
    def mask(match: re.Match[str]) -> str:
        lead, name, value = match.groups()
        return f"{lead}{name}={MASK}" if value and _is_secret_name(name) else match.group(0)

    return re.sub(_PARAM, mask, text) if "=" in text else text


def redact_url(url: str) -> str:
    """`url` with its user info and secret query parameters masked (`***`)."""
    try:
        parts = urlsplit(url)
    except ValueError:  # not a URL urllib can split (an odd bracket): mask what looks secret
        return re.sub(r"//[^/@\s]*@", f"//{MASK}@", url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, host = netloc.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        # A user name alone may be the token itself (`https://TOKEN@github.com`).
        netloc = f"{user}:{MASK}@{host}" if colon else f"{MASK}@{host}"
    query = _redact_params(parts.query)
    fragment = _redact_params(parts.fragment)
    if (netloc, query, fragment) == (parts.netloc, parts.query, parts.fragment):
        return url
    return urlunsplit((parts.scheme, netloc, parts.path, query, fragment))


def redact_text(text: str) -> str:
    """`text` with every URL in it passed through `redact_url`."""
    if "://" not in text:
        return text
    return re.sub(_URL, lambda m: redact_url(m.group(0)), text)


def install_log_redaction() -> None:
    """Mask secrets in URLs in every log record of this process from now on, whatever
    its handler (the default stderr one, uvicorn's); idempotent. Serving commands call it.
    """
    import logging  # here: importing logging costs every other command ~9 ms

    previous = logging.getLogRecordFactory()
    if getattr(previous, "redacts_urls", False):
        return

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        message = record.getMessage()
        if "://" in message:
            record.msg, record.args = redact_text(message), ()
        if record.exc_info and record.exc_info[1] is not None:
            # Formatted now, masked, and kept where every formatter looks first.
            record.exc_text = redact_text(logging.Formatter().formatException(record.exc_info))
        return record

    factory.redacts_urls = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(factory)
