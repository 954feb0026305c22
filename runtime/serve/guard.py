"""Who may call npu-serve, checked before a request reaches the API: an ASGI middleware.

A web page the user visits can send requests to a local server: a "simple" POST (text/plain or a
form) needs no CORS preflight, and with DNS rebinding (evil.example resolving to 127.0.0.1) the
page can even read the reply. So, in this order:
- Host must name this server: an IP literal or `localhost` when it listens on a loopback or
  wildcard address, the address it listens on otherwise, or a name given with --allowed-host.
  A rebinding page's requests carry its own name and are refused (403).
- Origin, when a browser sends one, must be the --cors-origin or this server itself (403).
- A CORS preflight (OPTIONS with Access-Control-Request-Method) is answered by the CORS layer
  before any API key check (a preflight never carries credentials).
- /v1 needs `Authorization: Bearer KEY` when --api-key is set; the scheme is case-insensitive
  (RFC 7235) and the key is compared in constant time (401).
- A POST must be `Content-Type: application/json` (415), and a Content-Length over
  --max-request-bytes is refused before a byte of the body is read (413); the route counts the
  bytes of a body sent without a length as they arrive.
"""
from __future__ import annotations

import hmac
import ipaddress
import json
from urllib.parse import urlsplit

from . import api

WILDCARDS = ("0.0.0.0", "::", "")


def _split_host(value: str) -> str:
    """'Host' header -> the host alone, lower case: '[::1]:8080' -> '::1', 'a.b:80' -> 'a.b'."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def _ip(host: str):
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


class HostCheck:
    def __init__(self, bound: str, allowed=()):
        self.bound = _split_host(bound)
        self.allowed = {_split_host(h) for h in allowed if h}
        bound_ip = _ip(self.bound)
        self.any_ip = self.bound in WILDCARDS or self.bound == "localhost" or bool(bound_ip and bound_ip.is_loopback)

    def ok(self, host_header: str | None) -> bool:
        if not host_header:
            return False
        host = _split_host(host_header)
        if host in self.allowed or host == self.bound:
            return True
        if self.any_ip:  # an IP literal cannot be rebound; a name other than localhost can
            return host == "localhost" or _ip(host) is not None
        return False


def _reply(status: int, message: str, code: str, kind: str = "invalid_request_error", headers=None):
    body = json.dumps(api.error_body(message, kind, None, code)).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    head += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]

    async def send_it(send):
        await send({"type": "http.response.start", "status": status, "headers": head})
        await send({"type": "http.response.body", "body": body})
    return send_it


class Guard:
    """ASGI middleware in front of the CORS layer and the app (see the module docstring)."""

    def __init__(self, app, hosts: HostCheck, api_key: str | None, cors_origin: str | None, max_request_bytes: int):
        self.app, self.hosts, self.api_key = app, hosts, api_key
        self.cors_origin = cors_origin.rstrip("/").lower() if cors_origin else None
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refusal = self.check(scope)
        if refusal is not None:
            return await refusal(send)
        return await self.app(scope, receive, send)

    def check(self, scope):
        headers = {}
        for k, v in scope.get("headers", []):
            headers.setdefault(k.decode("latin-1").lower(), v.decode("latin-1"))
        host = headers.get("host")
        if not self.hosts.ok(host):
            return _reply(403, f"Host {host!r:.80} is not this server; a web page cannot reach it by another name "
                               "(start npu-serve with --allowed-host NAME to allow one)", "host_not_allowed",
                          "permission_error")
        origin = headers.get("origin")
        if origin is not None and not self._origin_ok(origin, host):
            return _reply(403, f"requests from web pages at {origin!r:.80} are not allowed (start npu-serve with "
                               "--cors-origin ORIGIN to allow one)", "origin_not_allowed", "permission_error")
        method, path = scope.get("method", "GET"), scope.get("path", "")
        if method == "OPTIONS" and "access-control-request-method" in headers:
            return None  # a preflight: the CORS layer answers it (no credentials are sent with one)
        if self.api_key and path.startswith("/v1") and not self._key_ok(headers.get("authorization", "")):
            return _reply(401, "missing or wrong API key: send 'Authorization: Bearer KEY'", "invalid_api_key",
                          "authentication_error")
        if method == "POST":
            media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if media != "application/json":
                return _reply(415, f"Content-Type {media or 'none'!r:.60} is not accepted; send the body as "
                                   "application/json", "unsupported_media_type")
            length = headers.get("content-length")
            if length is not None and (not length.strip().isdigit() or int(length) > self.max_request_bytes):
                return too_large(self.max_request_bytes)
        return None

    def _origin_ok(self, origin: str, host: str | None) -> bool:
        origin = origin.rstrip("/").lower()
        if self.cors_origin and origin == self.cors_origin:
            return True
        parts = urlsplit(origin)  # the server's own page (same origin): scheme://Host
        return parts.scheme in ("http", "https") and bool(host) and parts.netloc == host.strip().lower()

    def _key_ok(self, value: str) -> bool:
        scheme, _, token = value.strip().partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())


def too_large_message(limit: int) -> str:
    return (f"the request body is over {limit:,} bytes, the bound --max-request-bytes sets (its default is sized "
            "from the context); send a shorter conversation or start npu-serve with a larger one")


def too_large(limit: int):
    return _reply(413, too_large_message(limit), "request_too_large")
