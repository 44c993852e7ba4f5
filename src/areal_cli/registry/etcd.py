"""The etcd registry: keys exactly as AReaL's etcd3 name_resolve writes them, under real leases.

    etcd://[USER@]HOST[:PORT][,HOST[:PORT]...][?ca=PEM&tls=1&password_file=F&timeout=S&connect_timeout=S]

It talks to etcd v3's HTTP/JSON gateway (etcd >= 3.4 serves it on the client port) with the
standard library only: small watchdog and runner processes and the CLI's start-up path import
this module. Endpoints are tried in order, starting with the last one that answered.

- Keys are AReaL's names, no leading slash, values plain text (base64 on the wire only):
  `<user>/<experiment>/<trial>/gen_servers/<id>` = "host:port".
- Every entry is put under a lease that etcd expires by itself: a server or host that dies
  without cleaning up drops out within its TTL, and readers never guess.
- Auth: `USER@` in the URL, the password from $AREAL_ETCD_PASSWORD or `password_file=`, never
  from the URL itself (the URL is handed to child processes in argv and environment).
- TLS: `ca=PEM` verifies the server against that CA; `tls=1` against the system's CAs.
- Every request is bounded: `connect_timeout=` (default 2 s) and `timeout=` (read, default
  5 s) per endpoint tried.
"""

from __future__ import annotations

import base64
import http.client
import json
import math
import os
import re
import socket
import ssl
import threading
from urllib.parse import parse_qsl

from areal_cli import settings
from areal_cli.errors import ArealError, UsageError, WaitTimeout
from areal_cli.registry.api import OWN_KEY, SERVERS_KEY, Registry, Skip

PASSWORD_ENV = "AREAL_ETCD_PASSWORD"
DEFAULT_PORT = 2379
CONNECT_TIMEOUT = 2.0
READ_TIMEOUT = 5.0
MAX_VALUE = 64 * 1024  # entries are a few hundred bytes; anything bigger is not ours
_PARAMS = ("ca", "tls", "password_file", "timeout", "connect_timeout")
# The server closed a kept-alive connection while it sat idle: worth one fresh try.
_HUNG_UP = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)
_HOST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$")
_URL_HINT = (
    "the form is etcd://[USER@]HOST[:PORT][,HOST[:PORT]...][?ca=PEM&password_file=FILE], "
    f"with the password in ${PASSWORD_ENV} or password_file="
)


class LeaseExpired(ArealError):
    """The lease is gone (expired or revoked), and with it every key put under it."""


class AccessDenied(UsageError):
    """The etcd user may not read or write these keys."""


class EtcdRegistry(Registry):
    kind = "etcd"
    leftovers_expire = (
        "etcd drops them when their lease runs out (the TTL: 30 s unless AREAL_REGISTRY_TTL)"
    )

    def __init__(self, client: _Client, user: str | None = None):
        self._client = client
        self.url = client.url
        self.user = user or settings.user()

    @classmethod
    def from_url(cls, url: str) -> EtcdRegistry:
        return cls(_Client.from_url(url))

    def for_user(self, user: str) -> EtcdRegistry:
        return EtcdRegistry(self._client, user)

    def close(self) -> None:
        self._client.close()

    def areal_name_resolve(self) -> list[str]:
        # AReaL's etcd3 repository takes one host:port (it splits on ':'), and connects
        # without user, password or TLS: the first endpoint is all it can use.
        host, port = self._client.endpoints[0]
        return [
            "cluster.name_resolve.type=etcd3",
            f"cluster.name_resolve.etcd3_addr={host}:{port}",
        ]

    def users(self) -> list[str]:
        """Users with servers or our entries: one keys-only range over the whole keyspace."""
        try:
            keys = self._client.range("\0", "\0", keys_only=True)
        except AccessDenied:
            return [self.user]  # a user allowed only its own keys sees only itself
        found = set()
        for key in keys:
            parts = key.split("/")
            if len(parts) >= 5 and parts[3] in (SERVERS_KEY, OWN_KEY):
                found.add(parts[0])
        return sorted(found)

    # -- backend primitives ---------------------------------------------------------------

    def _put(self, key: str, value: str, lease: str | None = None) -> None:
        body = {"key": _b64(key), "value": _b64(value)}
        if lease is not None:
            body["lease"] = lease
        self._client.call("/v3/kv/put", body)

    def _read_prefix(self, prefix: str) -> dict[str, str | Skip]:
        start = prefix + "/"
        out: dict[str, str | Skip] = {}
        for key, value in self._client.range(start, _prefix_end(start)).items():
            if len(value) > MAX_VALUE:
                out[key] = Skip(f"value is larger than {MAX_VALUE // 1024} KiB")
            else:
                out[key] = value.decode(errors="replace")
        return out

    def _delete(self, key: str) -> bool:
        reply = self._client.call("/v3/kv/deleterange", {"key": _b64(key)})
        return int(reply.get("deleted") or 0) > 0

    def _grant(self, ttl: float) -> str:
        # etcd counts whole seconds (and raises anything below its minimum, about 1-2 s).
        reply = self._client.call("/v3/lease/grant", {"TTL": max(1, math.ceil(ttl))})
        return str(reply["ID"])

    def _keepalive(self, lease: str) -> None:
        reply = self._client.call("/v3/lease/keepalive", {"ID": lease})
        reply = reply.get("result", reply)
        if int(reply.get("TTL", 0)) <= 0:
            raise LeaseExpired(f"lease {lease} on {self.url} has expired")

    def _revoke(self, lease: str) -> None:
        try:
            self._client.call("/v3/lease/revoke", {"ID": lease})
        except LeaseExpired:
            pass  # expired or revoked already: its keys are gone either way


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _prefix_end(prefix: str) -> str:
    """The range end that selects every key starting with `prefix` ('/' -> '0')."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


class _Client:
    """One etcd cluster behind its v3 JSON gateway: endpoints, credentials, one kept-alive
    connection, re-authentication when the token runs out."""

    def __init__(
        self,
        url: str,
        endpoints: list[tuple[str, int]],
        *,
        auth_user: str | None = None,
        password: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        connect_timeout: float = CONNECT_TIMEOUT,
        read_timeout: float = READ_TIMEOUT,
    ):
        self.url = url
        self.endpoints = endpoints
        self.auth_user = auth_user
        self._password = password
        self._ssl = ssl_context
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self._lock = threading.Lock()
        self._conn: http.client.HTTPConnection | None = None
        self._current = 0  # the endpoint that answered last
        self._token: str | None = None

    def __repr__(self) -> str:
        return f"_Client({self.url!r})"  # never the password

    # -- configuration ----------------------------------------------------------------------

    @classmethod
    def from_url(cls, url: str) -> _Client:
        url = url.strip()
        rest = url.removeprefix("etcd://")
        userinfo = rest.partition("?")[0].rpartition("@")[0]
        if ":" in userinfo:
            # Never repeat the password, not even in the error about it.
            shown = "etcd://" + rest.replace(userinfo, userinfo.partition(":")[0] + ":***", 1)
            raise _bad(
                shown,
                "the URL holds a password; it would show in the argv and environment of "
                f"every process started with it. Put it in ${PASSWORD_ENV} or a "
                "password_file= instead",
            )
        netloc, _, query = rest.partition("?")
        if "/" in netloc.rstrip("/") or "#" in netloc:
            raise _bad(url, "a path is not part of an etcd URL")
        netloc = netloc.rstrip("/")
        userinfo, at, hosts = netloc.rpartition("@")
        if at and not userinfo:
            raise _bad(url, "an empty user name before '@'")
        endpoints = [_endpoint(url, h) for h in hosts.split(",")]
        try:
            params = dict(parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)))
        except ValueError:
            raise _bad(url, f"cannot read the parameters {query!r}") from None
        unknown = sorted(set(params) - set(_PARAMS))
        if unknown:
            raise _bad(url, f"unknown parameter {', '.join(unknown)} (known: {', '.join(_PARAMS)})")
        timeouts = {k: _seconds(url, k, params.get(k), d) for k, d in
                    (("timeout", READ_TIMEOUT), ("connect_timeout", CONNECT_TIMEOUT))}  # fmt: skip
        tls = params.get("tls", "0")
        if tls not in ("0", "1"):
            raise _bad(url, f"tls={tls} (0 or 1)")
        if params.get("ca") == "":
            raise _bad(url, "ca= names no file")
        ssl_context = None
        if params.get("ca") or tls == "1":
            ssl_context = _ssl_context(url, params.get("ca"))
        password = None
        if at:
            password = _password(url, userinfo, params.get("password_file"))
        elif "password_file" in params:
            raise _bad(url, "password_file= without a user (etcd://USER@HOST:PORT)")
        return cls(
            url,
            endpoints,
            auth_user=userinfo or None,
            password=password,
            ssl_context=ssl_context,
            connect_timeout=timeouts["connect_timeout"],
            read_timeout=timeouts["timeout"],
        )

    # -- requests -----------------------------------------------------------------------------

    def range(self, key: str, end: str, keys_only: bool = False):
        """Keys in [key, end), as {key: value bytes} (or a list of keys with keys_only)."""
        body = {"key": _b64(key), "range_end": _b64(end)}
        if keys_only:
            body["keys_only"] = True
        kvs = self.call("/v3/kv/range", body).get("kvs", [])
        if keys_only:
            return [base64.b64decode(kv["key"]).decode(errors="replace") for kv in kvs]
        return {
            base64.b64decode(kv["key"]).decode(errors="replace"): base64.b64decode(
                kv.get("value", "")
            )
            for kv in kvs
        }

    def call(self, path: str, body: dict) -> dict:
        """POST to the gateway, logging in when needed. Raises UsageError (refused: bad
        credentials, not etcd, TLS), WaitTimeout (no endpoint answered), LeaseExpired."""
        with self._lock:
            if self.auth_user and self._token is None:
                self._token = self._authenticate()
            status, reply = self._post(path, body, self._token)
            if status == 401 and self.auth_user and "invalid auth token" in _message(reply):
                # Tokens expire (5 min by default) and die with an etcd restart: log in again.
                self._token = self._authenticate()
                status, reply = self._post(path, body, self._token)
        if status == 200:
            return reply
        raise self._refused(path, status, reply)

    def close(self) -> None:
        with self._lock:
            self._drop()

    def _authenticate(self) -> str:
        status, reply = self._post(
            "/v3/auth/authenticate", {"name": self.auth_user, "password": self._password}, None
        )
        if status == 200 and reply.get("token"):
            return reply["token"]
        msg = _message(reply)
        if "authentication failed" in msg or "invalid user" in msg:
            raise UsageError(
                f"etcd at {self.url} refused user {self.auth_user!r}: wrong user name or password",
                hint=f"check ${PASSWORD_ENV} (or the password_file= the URL names)",
            )
        if "authentication is not enabled" in msg:
            raise UsageError(
                f"etcd at {self.url} does not use authentication, but the URL names a user",
                hint="drop 'USER@' from the URL",
            )
        raise self._refused("/v3/auth/authenticate", status, reply)

    def _refused(self, path: str, status: int, reply: dict) -> ArealError:
        msg = _message(reply)
        if "lease not found" in msg:
            return LeaseExpired(f"the lease has expired on {self.url}")
        if "user name is empty" in msg:
            return UsageError(
                f"etcd at {self.url} requires a user and password",
                hint=f"etcd://USER@HOST:PORT, with the password in ${PASSWORD_ENV} "
                "or password_file=",
            )
        if "permission denied" in msg:
            return AccessDenied(
                f"etcd at {self.url} denied user {self.auth_user!r} access ({path})",
                hint="grant the user's role read and write on the keys under your user name",
            )
        if status == 404 and not msg:
            return UsageError(
                f"{self.url} does not serve etcd's v3 JSON gateway (HTTP 404 on {path})",
                hint="point the registry at an etcd >= 3.4 client port",
            )
        if "HTTPS server" in msg:
            return UsageError(
                f"etcd at {self.url} speaks TLS only",
                hint="add ?ca=/path/to/ca.pem (or ?tls=1) to the URL",
            )
        return UsageError(f"etcd at {self.url} refused {path}: HTTP {status} {msg or reply}")

    # -- the wire ----------------------------------------------------------------------------

    def _post(self, path: str, body: dict, token: str | None) -> tuple[int, dict]:
        """One request, on the endpoint that answered last, then on each other one in turn.
        A server's refusal comes back as (status, reply); no answer at all is a WaitTimeout."""
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = token  # the gateway takes the raw token, no "Bearer"
        failures = []
        n = len(self.endpoints)
        for i in range(n):
            index = (self._current + i) % n
            host, port = self.endpoints[index]
            if index != self._current:
                self._drop()
                self._current = index
            # A kept-alive connection that the server closed meanwhile gets one fresh retry.
            for attempt in (0, 1):
                reused = self._conn is not None
                try:
                    status, raw = self._exchange(path, data, headers)
                except ssl.SSLCertVerificationError as e:
                    self._drop()
                    raise UsageError(
                        f"etcd at {self.url}: the certificate of {_hostport(host, port)} is not "
                        f"trusted ({e.verify_message or e.reason})",
                        hint="ca= must name the CA that signed the etcd server's certificate",
                    ) from None
                except ssl.SSLError as e:
                    self._drop()
                    raise self._tls_failed(host, port, str(e.reason or e)) from None
                except (OSError, http.client.HTTPException) as e:
                    self._drop()
                    if reused and attempt == 0 and isinstance(e, _HUNG_UP):
                        continue
                    if (
                        # etcd hangs up on plain HTTP at a TLS-only port: a close or a reset,
                        # as the timing falls
                        isinstance(e, (http.client.RemoteDisconnected, ConnectionResetError))
                        and self._ssl is None
                        and self._speaks_tls(host, port)
                    ):
                        raise UsageError(
                            f"etcd at {self.url} speaks TLS only ({_hostport(host, port)})",
                            hint="add ?ca=/path/to/ca.pem (or ?tls=1) to the URL",
                        ) from None
                    if (
                        isinstance(e, ConnectionResetError)
                        and self._ssl is not None
                        and not self._speaks_tls(host, port)
                    ):
                        # A plain etcd answers a TLS hello with a reset as often as with a
                        # reply that fails the handshake.
                        raise self._tls_failed(host, port, "it does not speak TLS") from None
                    failures.append(f"{_hostport(host, port)}: {_why(e)}")
                    break
                if status >= 500:
                    # A member without a leader, or overloaded: another may do better.
                    self._drop()
                    failures.append(f"{_hostport(host, port)}: HTTP {status} {_message(raw)}")
                    break
                return status, raw
        raise WaitTimeout(
            f"etcd at {self.url} did not answer ({'; '.join(failures)})",
            hint="check that etcd runs there and is reachable from this host, "
            "or pick another --registry (or AREAL_REGISTRY)",
        )

    def _exchange(self, path: str, data: bytes, headers: dict) -> tuple[int, dict]:
        if self._conn is None:
            host, port = self.endpoints[self._current]
            if self._ssl is not None:
                conn = http.client.HTTPSConnection(
                    host, port, timeout=self.connect_timeout, context=self._ssl
                )
            else:
                conn = http.client.HTTPConnection(host, port, timeout=self.connect_timeout)
            conn.connect()
            conn.sock.settimeout(self.read_timeout)
            self._conn = conn
        self._conn.request("POST", path, data, headers)
        resp = self._conn.getresponse()
        raw = resp.read()
        if resp.will_close:
            self._drop()
        try:
            # keepalive answers as a stream: one {"result": ...} object per line
            reply = json.loads(raw.split(b"\n", 1)[0]) if raw.strip() else {}
        except ValueError:
            reply = {"message": raw[:200].decode(errors="replace").strip()}
        if not isinstance(reply, dict):
            reply = {"message": str(reply)[:200]}
        return resp.status, reply

    def _tls_failed(self, host: str, port: int, why: str) -> UsageError:
        return UsageError(
            f"etcd at {self.url}: TLS with {_hostport(host, port)} failed ({why})",
            hint="drop ca=/tls= if that etcd serves plain HTTP",
        )

    def _speaks_tls(self, host: str, port: int) -> bool:
        """Whether the endpoint that hung up on plain HTTP completes a TLS handshake (etcd
        closes plain connections on a TLS-only port without a word)."""
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        try:
            with socket.create_connection((host, port), timeout=self.connect_timeout) as sock:
                sock.settimeout(self.read_timeout)
                with ctx.wrap_socket(sock):
                    return True
        except (OSError, ValueError):
            return False

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


# -- parsing the URL ----------------------------------------------------------------------


def _bad(url: str, why: str) -> UsageError:
    return UsageError(f"bad etcd registry URL {url!r}: {why}", hint=_URL_HINT)


def _endpoint(url: str, text: str) -> tuple[str, int]:
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        if rest and not rest.startswith(":"):
            raise _bad(url, f"cannot read the endpoint {text!r}")
        port_text = rest[1:] if rest else ""
        try:
            socket.inet_pton(socket.AF_INET6, host)
        except OSError:
            raise _bad(url, f"{host!r} is not an IPv6 address") from None
    else:
        host, _, port_text = text.partition(":")
        if not host:
            raise _bad(url, "no host" if not text else f"no host in {text!r}")
        if not _HOST.match(host):
            raise _bad(url, f"{host!r} is not a host name or address")
    if not port_text:
        return host, DEFAULT_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise _bad(url, f"port {port_text!r} is not a number from 1 to 65535")
    return host, int(port_text)


def _seconds(url: str, name: str, text: str | None, default: float) -> float:
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 600:
        raise _bad(url, f"{name}={text} (seconds, more than 0 and at most 600)")
    return value


def _ssl_context(url: str, ca: str | None) -> ssl.SSLContext:
    try:
        return ssl.create_default_context(cafile=os.path.expanduser(ca) if ca else None)
    except FileNotFoundError:
        raise UsageError(
            f"etcd registry {url}: no CA file at {ca}", hint="ca= names a PEM file"
        ) from None
    except (ssl.SSLError, OSError, ValueError) as e:
        raise UsageError(
            f"etcd registry {url}: cannot load the CA file {ca} ({getattr(e, 'reason', None) or e})",
            hint="ca= names a PEM file holding the CA certificate",
        ) from None


def _password(url: str, user: str, password_file: str | None) -> str:
    if password_file:
        path = os.path.expanduser(password_file)
        try:
            with open(path) as f:
                return f.read().rstrip("\r\n")
        except OSError as e:
            raise UsageError(
                f"etcd registry {url}: cannot read password_file {path} ({e.strerror or e})"
            ) from None
    password = os.environ.get(PASSWORD_ENV)
    if password:
        return password
    raise UsageError(
        f"etcd registry {url} names user {user!r} but no password",
        hint=f"set ${PASSWORD_ENV}, or add password_file=FILE to the URL",
    )


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _message(reply: dict) -> str:
    return str(reply.get("message") or reply.get("error") or "")


def _why(e: BaseException) -> str:
    if isinstance(e, TimeoutError):
        return "timed out"
    if isinstance(e, ConnectionRefusedError):
        return "connection refused"
    if isinstance(e, socket.gaierror):
        return f"unknown host ({e.strerror or e})"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror.lower()
    return str(e) or type(e).__name__
