"""The one redaction every line kvtier prints goes through: no password ever shown.

`redact(text)` replaces, in a URL or in any text holding URLs (an exception's message, a log
line): the password of a URL's user info (`redis://user:pw@host` -> `redis://user:***@host`),
the value of a secret-like query parameter (`?password=pw`, `&ssl_password=pw`, `&token=t`), and a
password `key=value` / `'key': 'value'` pair (a client's keyword arguments echoed in an
error). User, host, port, path and db stay: the line still says which server.
"""

from __future__ import annotations

import re
from typing import Any

MASK = "***"
_SECRET_NAME = r"[\w.-]*(?:password|passwd|pwd|secret|token)[\w.-]*"   # in a URL's query
_PASSWORD_NAME = r"[\w-]*pass(?:word|wd)[\w-]*"                           # anywhere
# scheme://[user]:password@  (user info up to the last '@' before the host's end)
_USERINFO = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://(?P<user>[^/?#\s@:]*)):(?P<pw>[^/?#\s]*)@")
# ?password=pw, &ssl_password=pw, ;token=pw
_QUERY = re.compile(rf"(?P<head>[?&;]{_SECRET_NAME}=)(?P<pw>[^&#\s'\"\\]*)", re.IGNORECASE)
# password='pw', "password": "pw", password=pw, a YAML line's `password: pw` (a client's keyword
# arguments, a dict or a config line echoed in an error); not `tiers.1.password: <message>`
_PAIR = re.compile(rf"(?P<head>(?<![\w.-]){_PASSWORD_NAME}(?:\s*=\s*|['\"]?\s*:\s*))"
                   r"""(?P<pw>'[^']*'|"[^"]*"|[^'"\s,;&)}\]]+)""", re.IGNORECASE)


def redact(text: str) -> str:
    """`text` with every password in it (URL user info, query parameter, key=value) as `***`."""
    if not text:
        return text
    text = _USERINFO.sub(lambda m: f"{m['head']}:{MASK}@", text)
    text = _QUERY.sub(lambda m: m["head"] + MASK, text)
    return _PAIR.sub(lambda m: m["head"] + (m["pw"][0] + MASK + m["pw"][0] if m["pw"][0] in "'\"" else MASK), text)


def redact_all(obj: Any) -> Any:
    """`obj` (a command's result: dicts, lists, strings) with `redact` applied to every string in it."""
    if isinstance(obj, str):
        return redact(obj)
    if isinstance(obj, dict):
        return {redact_all(k): redact_all(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [redact_all(v) for v in obj]
    return obj
