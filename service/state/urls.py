"""The one redaction rule for every URL the service prints: the state database's
(`GANGSERVE_DATABASE_URL`), the artifact store's (`GANGSERVE_STORAGE_URL`) and an S3 endpoint's.

Rule: the whole userinfo (`user:password@`, or a lone `user@`: on S3 it is the access key)
becomes `***@`, and the value of every query parameter whose name says it is a credential
(contains `secret`, `key`, `token`, `pass` or `credential`: `password=`, `passfile=`,
`sslpassword=`, `sslkey=`, `secret_key=`, `X-Amz-Security-Token=` ...) becomes `***`. Nothing
else changes: a URL with nothing to hide comes back exactly as given (`sqlite:///x` keeps its
three slashes).
"""
from __future__ import annotations

import re
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit

MASK = "***"
_CREDENTIAL_PARAM = re.compile(r"secret|key|token|pass|credential", re.IGNORECASE)


def redact(url: str) -> str:
    """`url` safe to log and to put in error messages (see the module's rule)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable URL>"
    netloc = parts.netloc
    if "@" in netloc:
        netloc = f"{MASK}@{netloc.rsplit('@', 1)[1]}"
    query = "&".join(
        f"{name}={MASK}" if _CREDENTIAL_PARAM.search(name) else (f"{name}={value}" if sep else name)
        for name, sep, value in (item.partition("=") for item in parts.query.split("&") if item)
    )
    if (netloc, query) == (parts.netloc, parts.query):
        return url  # nothing secret (urlunsplit would also drop sqlite:///'s empty host)
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def secrets_of(url: str) -> list[str]:
    """The passwords in `url` (of its userinfo, as written and decoded, and the values of
    credential query parameters), to scrub from driver messages that may echo them. Strings
    shorter than 3 characters are left out (they would mangle any text); longest first."""
    try:
        parts = urlsplit(url)
        userinfo = parts.netloc.rsplit("@", 1)[0] if "@" in parts.netloc else ""
        password = userinfo.split(":", 1)[1] if ":" in userinfo else ""
        found = [password, unquote(password)]
        found += [v for k, v in parse_qsl(parts.query) if _CREDENTIAL_PARAM.search(k)]
    except ValueError:
        return []
    return sorted({s for s in found if len(s) >= 3}, key=len, reverse=True)
