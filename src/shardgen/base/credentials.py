"""Credentials in URLs: the patterns that find them (``trust`` refuses them in a config) and ``redact``,
which hides them wherever a URL is shown (object storage's messages)."""

from __future__ import annotations

import re

# Credentials in a URL, which ``trust.CREDENTIAL_PATTERNS`` refuses in a config and ``redact`` hides where a
# URL is shown. A userinfo with a password, 'scheme://user:password@': the password may hold a '/' (no
# valid URL, but written, and read as one by some clients), except where what follows the ':' is a port
# and a path ('http://host:8000/docs/me@x' names no one's password).
USER_PASSWORD = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/\s:@?#]+:(?!\d+(/|$))[^\s@]+@")
# A web URL's userinfo of one part, 'https://token@host': a token, as services take one ('ssh://git@...'
# names a user; 'git@github.com:...' and an e-mail address are no URL).
USER_TOKEN = re.compile(r"(?P<scheme>\b(https?|wss?)://)[^/\s:@?#]+@(?=[^\s/@])", re.IGNORECASE)
# A query parameter that carries one: 'key', 'sig' (Azure's SAS), 'AWSAccessKeyId', or a name that ends
# with token, signature, credential, secret, password or api key ('X-Amz-Security-Token', 'access_token',
# 'client_secret', 'X-Goog-Signature'; not 'sort_key').
QUERY_CREDENTIAL = re.compile(
    r"(?P<name>[?&](key|sig|awsaccesskeyid|([\w.-]*[_-])?(token|signature|credential|secret|password|passwd"
    r"|api_?key|apikey))=)[^&\s#]+",
    re.IGNORECASE,
)


def redact(text: str) -> str:
    """``text`` with the credentials of its URLs (their userinfo, the values of their query parameters
    that carry one) as '***': what a message may show of a URL (a config's were checked, but an error's
    text or a caller's URL were not)."""
    text = USER_TOKEN.sub(r"\g<scheme>***@", USER_PASSWORD.sub(r"\g<scheme>***@", text))
    return QUERY_CREDENTIAL.sub(r"\g<name>***", text)
