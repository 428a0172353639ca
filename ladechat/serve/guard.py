"""Requests `ladechat serve` refuses before it reads them: from another site's web page (Guard:
another Origin, a Host that is not the server's, a body that is not JSON), and bodies over
MAX_BODY (read_body)."""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.requests import Request

from ladechat.serve.wire import ApiError

MAX_BODY = 8 * 1024 * 1024  # bytes of JSON in one request


async def read_body(request: Request, timeout: float | None = None) -> bytes:
    """The request's body, refused (413) as soon as it is known to be over MAX_BODY: a Content-Length
    before any of it is read, a body without one (chunked) once that much has come; 408 when it has
    not all come within `timeout` seconds. A client that leaves before it is whole gets no answer
    and leaves no trace in the log (ClientGone)."""
    import anyio
    from starlette.requests import ClientDisconnect

    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY:
        raise too_large(int(length))
    body = bytearray()
    try:
        with anyio.fail_after(timeout):
            async for chunk in request.stream():
                body += chunk
                if len(body) > MAX_BODY:
                    raise too_large(len(body), more=True)
    except TimeoutError:
        raise ApiError(408, f"the request body did not all arrive within {timeout:g} s",
                       headers={"Connection": "close"}) from None
    except ClientDisconnect:
        raise ClientGone() from None
    return bytes(body)


class ClientGone(Exception):
    """The client closed its connection before its request was whole: nothing to answer."""


def too_large(size: int, more: bool = False) -> ApiError:
    """413 for a body over MAX_BODY; the connection is closed after it, so the rest of the body is
    not read either."""
    close = {"Connection": "close"}
    if more:  # a body without a Content-Length, cut where it passed the limit
        return ApiError(413, f"the request body is more than the {MAX_BODY} bytes this server takes", headers=close)
    return ApiError(413, f"the request body is {size} bytes, more than the {MAX_BODY} this server takes", headers=close)



# -- cross-site requests ----------------------------------------------------------------------
class Guard:
    """ASGI middleware that refuses what a web page in the user's browser could make of a server on
    this machine: a request from another site (an Origin that is not the server's own or one the
    operator allowed: 403), a DNS-rebinding page's (a Host that is not the server's, when it listens
    on loopback: 403) and a body that is not JSON (415: text/plain, a form or no type at all are
    what a page may POST anywhere without asking the server first)."""

    def __init__(self, app, hosts: frozenset[str] | None, origins: frozenset[str]) -> None:
        self.app, self.hosts, self.origins = app, hosts, origins

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        host = headers.get("host", "")
        refusal = None
        if self.hosts is not None and host_name(host) not in self.hosts:
            refusal = ApiError(403, f"the Host header {host!r} does not name this server "
                                    f"({' or '.join(sorted(self.hosts))}); refused as DNS rebinding would send it",
                               code="forbidden_host")
        elif (origin := headers.get("origin")) is not None and not self.origin_allowed(origin, host):
            refusal = ApiError(403, f"requests from the web page at {origin} are refused (start the server with "
                                    f"--allow-origin {origin} to allow them)", code="forbidden_origin")
        elif scope["method"] == "POST" and not is_json(headers.get("content-type")):
            given = headers.get("content-type")
            refusal = ApiError(415, "the request body must be JSON, sent with Content-Type: application/json"
                                    + (f" (not {given})" if given else ""), code="unsupported_media_type")
        if refusal is not None:
            return await refusal.response()(scope, receive, send)
        await self.app(scope, receive, send)

    def origin_allowed(self, origin: str, host: str) -> bool:
        origin = origin.rstrip("/").lower()
        return "*" in self.origins or origin in self.origins or origin == f"http://{host}".lower()


def host_name(host: str) -> str:
    """The name in a Host header: "[::1]:8000" -> "::1", "LocalHost.:80" -> "localhost"."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0].rstrip(".") if host.count(":") == 1 else host.rstrip(".")


def is_json(content_type: str | None) -> bool:
    kind = (content_type or "").split(";")[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


def allowed_hosts(host: str, bound: str) -> frozenset[str] | None:
    """The Host names a server listening on `host` (bound to address `bound`) takes: on loopback its
    address, the name it was given and localhost; elsewhere (which needs an API key) any."""
    if not is_loopback(bound):
        return None
    return frozenset({host_name(host), host_name(f"[{bound}]" if ":" in bound else bound), "localhost"})


def normal_origin(origin: str) -> str:
    """An --allow-origin value as browsers send it ("*", or scheme://host[:port]); ValueError if not one."""
    from urllib.parse import urlsplit

    if origin == "*":
        return origin
    parts = urlsplit(origin)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.path not in ("", "/") or parts.query:
        raise ValueError(f"an origin is scheme://host[:port] (e.g. http://localhost:3000) or *, got {origin!r}")
    return f"{parts.scheme}://{parts.netloc}".lower()


def is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
