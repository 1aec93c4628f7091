"""The HTTP client of a live SGLang server: server info, health, /metrics text, load, and the
profile endpoints, each failure one `SglangError` line.

Checked against SGLang 0.5.10.post1's own code, run on a CPU by tests/test_sglang_real.py
(`bench/sglang_cpu_env.sh` installs it). What kdash relies on:

- `/server_info` (`/get_server_info` is the old name: it still answers, and logs a WARNING on
  every call, so it is asked only when `/server_info` is 404). `/v1/loads` gives, per DP rank,
  `num_running_reqs`, `num_waiting_reqs`, `num_used_tokens`, `max_total_num_tokens`,
  `token_usage`, `gen_throughput`, `utilization`, with or without `--enable-metrics`;
  `/get_load` (deprecated, warns on every call) is asked only when it is 404, and its
  `num_reqs` counts running and waiting requests together.
- Two keys. `/metrics` and `/health*` never need a key. `/server_info`, `/v1/loads` and
  `/get_load` need `--api-key` when the server has one; `/start_profile` and `/stop_profile`
  need `--admin-api-key` when the server has one (then `--api-key` is refused there), else
  `--api-key`. The client sends the admin key to the profile endpoints and the plain key to
  the rest; with only one given it is used for both.

Errors are `SglangError` (a `UserError`): one line that names the endpoint and says what to do,
with a `kind` ("refused", "timeout", "unauthorized", "busy", "not_found", "http", "bad_reply")
for code that must branch on it (the capture flow, the metrics source's fallback).
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kdash.errors import UserError

if TYPE_CHECKING:
    from .sglang_profile import ProfileRequest


class SglangError(UserError):
    """One-line failure of an SGLang endpoint; `kind` says which for callers that branch."""

    def __init__(self, message: str, kind: str, status: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.status = status


ADMIN_PATHS = ("/start_profile", "/stop_profile")


class SglangClient:
    """urllib client with timeouts; every failure becomes one `SglangError` line.

    `api_key` goes to the plain endpoints, `admin_api_key` (else `api_key`) to the profile ones;
    nothing to /metrics and /health, which never want one.
    """

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        timeout_s: float = 5.0,
        admin_api_key: str | None = None,
    ) -> None:
        text = url.strip().rstrip("/")
        if "://" not in text:
            text = "http://" + text
        self.base = text
        self.api_key = api_key
        self.admin_api_key = admin_api_key
        self.timeout_s = timeout_s
        # Which name of an endpoint this server answers, once known ("/server_info" or the
        # old "/get_server_info"; "/v1/loads" or "/get_load").
        self._info_path: str | None = None
        self._load_path: str | None = None
        # No proxies: kdash runs on the server's own machine, and an http_proxy set for the
        # user's downloads must not swallow requests to 127.0.0.1.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    # -- plumbing --------------------------------------------------------------------------
    def _request(
        self,
        path: str,
        body: Mapping[str, Any] | None = None,
        method: str | None = None,
        timeout_s: float | None = None,
    ) -> tuple[int, str]:
        data = None
        headers = {"Accept": "*/*", "User-Agent": "kdash"}
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        key = self._key_for(path)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        req = urllib.request.Request(
            self.base + path,
            data=data,
            headers=headers,
            method=method or ("POST" if data else "GET"),
        )
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            with self._opener.open(req, timeout=timeout) as resp:
                return resp.status, resp.read().decode(errors="replace")
        except urllib.error.HTTPError as e:
            try:
                text = e.read().decode(errors="replace")
            except OSError:
                text = ""
            raise self._http_error(path, e.code, text) from None
        except urllib.error.URLError as e:
            raise self._conn_error(path, e.reason, timeout) from None
        except TimeoutError:
            raise SglangError(
                f"{self.base}{path}: no answer in {timeout:g} s (server busy or hung?)", "timeout"
            ) from None
        except (ConnectionError, OSError) as e:
            raise self._conn_error(path, e, timeout) from None

    def _key_for(self, path: str) -> str | None:
        if path.startswith(("/metrics", "/health")):
            return None
        if path in ADMIN_PATHS:
            return self.admin_api_key or self.api_key
        return self.api_key or self.admin_api_key

    def _conn_error(self, path: str, reason: object, timeout: float) -> SglangError:
        if isinstance(reason, ConnectionRefusedError):
            return SglangError(
                f"cannot connect to SGLang at {self.base}: connection refused (is the server "
                "up, and is this its port?)",
                "refused",
            )
        if isinstance(reason, TimeoutError | socket.timeout):
            return SglangError(
                f"{self.base}{path}: no answer in {timeout:g} s (server busy or hung?)", "timeout"
            )
        if isinstance(reason, socket.gaierror):
            return SglangError(f"cannot resolve the host of {self.base}: {reason}", "refused")
        text = getattr(reason, "strerror", None) or str(reason)
        return SglangError(f"cannot reach SGLang at {self.base}: {text}", "refused")

    def _http_error(self, path: str, status: int, text: str) -> SglangError:
        detail = _one_line(_error_message(text))
        if status in (401, 403):
            if path in ADMIN_PATHS:
                sent = "no key" if not self._key_for(path) else "the key kdash sent"
                hint = (
                    f"{sent} was refused: give kdash the server's --admin-api-key "
                    "(--admin-api-key), or its --api-key when it has no admin key"
                )
            else:
                sent = "no key" if not self._key_for(path) else "the key kdash sent"
                hint = f"{sent} was refused: give kdash the server's --api-key (--api-key)"
            return SglangError(
                f"{self.base}{path}: {status} unauthorized — {hint}", "unauthorized", status
            )
        if "already" in detail.lower() and "profil" in detail.lower():
            return SglangError(
                f"{self.base}{path}: a profile is already running on the server (wait for it "
                "or call /stop_profile)",
                "busy",
                status,
            )
        if status == 404:
            return SglangError(f"{self.base}{path}: 404 not found", "not_found", status)
        if path == "/start_profile" and status >= 500:
            return SglangError(
                f"{self.base}{path}: the server refused to start a profile ({status} "
                f"{detail or 'server error'}; usually one is already running — see its log)",
                "busy",
                status,
            )
        if path == "/stop_profile" and status >= 500:
            return SglangError(
                f"{self.base}{path}: the server refused to stop ({status} "
                f"{detail or 'server error'}; usually no profile is running)",
                "http",
                status,
            )
        return SglangError(
            f"{self.base}{path}: HTTP {status} {detail or 'error'}".rstrip(), "http", status
        )

    def _json(self, path: str, text: str) -> Any:
        try:
            return json.loads(text)
        except ValueError:
            raise SglangError(
                f"{self.base}{path}: answer is not JSON (is this an SGLang server?)", "bad_reply"
            ) from None

    # -- endpoints -------------------------------------------------------------------------
    def _first_of(self, paths: tuple[str, ...], known: str | None, **kw: Any) -> tuple[str, str]:
        """(path, text) of the first of `paths` that is not 404 (the known one first)."""
        order = (known,) if known else paths
        err: SglangError | None = None
        for path in order:
            try:
                return path, self._request(path, **kw)[1]
            except SglangError as e:
                if e.kind != "not_found":
                    raise
                err = e
        assert err is not None
        raise err

    def get_server_info(self) -> dict[str, Any]:
        path, text = self._first_of(("/server_info", "/get_server_info"), self._info_path)
        self._info_path = path
        info = self._json(path, text)
        if not isinstance(info, dict):
            raise SglangError(f"{self.base}{path}: not an object", "bad_reply")
        return info

    def health(self, timeout_s: float | None = None) -> int:
        """HTTP status of /health (200 up, 503 starting or shutting down); needs no key."""
        try:
            return self._request("/health", timeout_s=timeout_s)[0]
        except SglangError as e:
            if e.status is not None:
                return e.status
            raise

    def metrics_text(self, timeout_s: float | None = None) -> str:
        """Prometheus text of /metrics; SglangError kind "not_found" when metrics are off."""
        return self._request("/metrics", timeout_s=timeout_s)[1]

    def get_load(self, timeout_s: float | None = None) -> list[dict[str, Any]]:
        """One dict per DP rank, from /v1/loads (else the old /get_load); each dict carries
        `_endpoint` so `load_rows` knows which counting it holds."""
        path, text = self._first_of(
            ("/v1/loads", "/get_load"), self._load_path, timeout_s=timeout_s
        )
        self._load_path = path
        data = self._json(path, text)
        if path == "/v1/loads" and isinstance(data, dict):
            data = data.get("loads")
        elif isinstance(data, dict):
            data = [data]
        if not isinstance(data, list) or not all(isinstance(d, dict) for d in data):
            raise SglangError(f"{self.base}{path}: unexpected answer shape", "bad_reply")
        return [dict(d, _endpoint=path) for d in data]

    def start_profile(self, req: ProfileRequest) -> str:
        """Start a torch.profiler window in every scheduler; returns the server's text."""
        _, text = self._request("/start_profile", body=req.to_json(), method="POST")
        return text.strip()

    def stop_profile(self, timeout_s: float | None = None) -> str:
        """Stop it; the schedulers write their trace files after answering (takes seconds)."""
        _, text = self._request("/stop_profile", body={}, method="POST", timeout_s=timeout_s)
        return text.strip()


def _error_message(text: str) -> str:
    """The message of a JSON error body (FastAPI/OpenAI shapes), else the text itself."""
    try:
        data = json.loads(text)
    except ValueError:
        return text
    if isinstance(data, dict):
        for key in ("message", "detail", "error"):
            v = data.get(key)
            if isinstance(v, dict):
                v = v.get("message")
            if isinstance(v, str) and v:
                return v
    return text


def _one_line(text: str, limit: int = 160) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."
