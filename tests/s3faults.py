"""An HTTP proxy in front of the S3 test server that answers some requests itself, as a real store
does under load or with a policy that denies: the first ``throttle`` requests for each object (method
and path) get 503 SlowDown, any write under ``deny`` gets 403 AccessDenied (S3's XML errors), every
read too once ``deny_reads`` is set (credentials that another node does not have), and with
``signed_only`` any request that carries no signature (a client that found no credentials), as S3
answers an anonymous request for a private bucket.
Everything else goes to the server as it came (moto does not check signatures, so the Host the
client signed for does not matter)."""

from __future__ import annotations

import http.client
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

ERROR = "<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code><Message>{message}</Message></Error>"


class FaultProxy:
    def __init__(self, upstream: str, throttle: int = 0, deny: str | None = None, signed_only: bool = False) -> None:
        self.upstream = urlsplit(upstream)
        self.throttle, self.deny, self.signed_only = throttle, deny, signed_only
        self.deny_reads = False  # set it to answer every read with 403 from then on
        self.seen: Counter[tuple[str, str]] = Counter()
        self.throttled = self.denied = 0
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _answer(self, status: int, body: bytes, headers: list[tuple[str, str]]) -> None:
                self.send_response(status)
                length = str(len(body))
                for k, v in headers:
                    if k.lower() == "content-length" and self.command == "HEAD":
                        length = v  # the object's size, which a HEAD answers with no body
                    elif k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", length)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _fault(self) -> tuple[int, str, str] | None:
                path = urlsplit(self.path).path
                with proxy._lock:
                    proxy.seen[(self.command, path)] += 1
                    signed = "Authorization" in self.headers or "X-Amz-Credential" in self.path
                    if (proxy.deny_reads and self.command in ("GET", "HEAD")) or (proxy.signed_only and not signed):
                        proxy.denied += 1
                        return 403, "AccessDenied", "Access Denied"
                    if proxy.deny and self.command in ("PUT", "POST", "DELETE") and path.startswith(proxy.deny):
                        proxy.denied += 1
                        return 403, "AccessDenied", "Access Denied"
                    if proxy.seen[(self.command, path)] <= proxy.throttle:
                        proxy.throttled += 1
                        return 503, "SlowDown", "Please reduce your request rate."
                return None

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() != "chunked":
                    length = int(self.headers.get("Content-Length") or 0)
                    return self.rfile.read(length) if length else b""
                chunks = []  # forwarded whole, with its length
                while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                    pass
                return b"".join(chunks)

            def _handle(self) -> None:
                body = self._body()
                fault = self._fault()
                if fault is not None:
                    status, code, message = fault
                    self._answer(status, ERROR.format(code=code, message=message).encode(),
                                 [("Content-Type", "application/xml")])  # fmt: skip
                    return
                conn = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=60)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() != "transfer-encoding"}
                    headers["Content-Length"] = str(len(body))
                    conn.request(self.command, self.path, body=body, headers=headers)
                    r = conn.getresponse()
                    self._answer(r.status, r.read(), r.getheaders())
                finally:
                    conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
