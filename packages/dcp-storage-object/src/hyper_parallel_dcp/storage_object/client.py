"""``ObjectStore``: the S3 requests a checkpoint needs, each with a timeout, retried when transient.

Built on botocore's low-level client, its own retries off: :meth:`ObjectStore._call` retries
5xx, throttling and connection errors with jittered backoff and raises a permanent error as
:class:`ObjectStoreError` naming bucket and key.  Configured from the ``AWS_*`` environment.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, TypeVar

from hyper_parallel_dcp.core.errors import CheckpointError, CheckpointNotFoundError
from hyper_parallel_dcp.core.settings import OBJECT_LOCK_STALE_AFTER, configure_from_env

__all__ = ["ObjectStore", "ObjectStoreError", "ObjectStoreSettings", "parse_url"]

# a child of the timing logger: retries show with the per-phase lines (HP_LOG_CONFIG=DCP:INFO)
logger = logging.getLogger("hyper_parallel_dcp.timing").getChild("storage_object")

T = TypeVar("T")
MiB = 1 << 20


@dataclass(frozen=True)
class ObjectStoreSettings:
    """Transfer settings (defaults measured against a local server, see the README).

    Uploads of ``multipart_threshold`` bytes or more go in parts of ``part_size`` (>= 5 MiB);
    reads are ranged GETs of at most ``range_size``.  Each request has the timeouts and
    ``max_attempts`` tries, jittered backoff ``backoff_base * 2**n`` up to ``backoff_max``.
    A lock object is rewritten every ``lock_refresh`` s (0: a sixth of ``lock_stale_after``)
    and taken over once not rewritten for ``lock_stale_after`` s.
    """

    part_size: int = 16 * MiB
    multipart_threshold: int = 64 * MiB
    upload_concurrency: int = 8
    read_concurrency: int = 8
    range_size: int = 16 * MiB
    connect_timeout: float = 10.0
    read_timeout: float = 60.0
    max_attempts: int = 6
    backoff_base: float = 0.2
    backoff_max: float = 10.0
    endpoint_url: Optional[str] = None
    lock_stale_after: float = field(default_factory=OBJECT_LOCK_STALE_AFTER.get)
    lock_refresh: float = 0.0

    def __post_init__(self) -> None:
        if not self.lock_refresh:
            object.__setattr__(self, "lock_refresh", self.lock_stale_after / 6)
        if self.part_size < 5 * MiB:
            raise ValueError(f"part_size must be at least 5 MiB (S3's minimum part), got {self.part_size}")
        if self.multipart_threshold < self.part_size:
            raise ValueError("multipart_threshold must be at least part_size")
        for name in ("upload_concurrency", "read_concurrency", "range_size", "max_attempts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.connect_timeout <= 0 or self.read_timeout <= 0:
            raise ValueError("timeouts must be positive")
        if not 0 < self.lock_refresh < self.lock_stale_after:
            raise ValueError(f"lock_refresh must be positive and below lock_stale_after, got {self.lock_refresh} "
                             f"and {self.lock_stale_after}")


class ObjectStoreError(CheckpointError, OSError):
    """A request to the object store failed for good; the message names bucket and key."""


def parse_url(url: str) -> tuple[str, str, str]:
    """``s3://bucket/a/b`` → ``("s3", "bucket", "a/b")``; ``ValueError`` for a URL without a bucket."""
    scheme, sep, rest = str(url).partition("://")
    if not sep:
        raise ValueError(f"{url!r} is not an object-store URL (expected s3://bucket/prefix)")
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise ValueError(f"{url!r} names no bucket (expected {scheme}://bucket/prefix)")
    return scheme.lower(), bucket, prefix.strip("/")


#: The standard variables the client is configured from (SPEC §11).
_AWS_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
            "AWS_SESSION_TOKEN", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE")


def _endpoint(settings: ObjectStoreSettings, env: dict[str, str]) -> Optional[str]:
    return settings.endpoint_url or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")


_clients: dict[tuple[int, ObjectStoreSettings, tuple[tuple[str, str], ...]], Any] = {}
_clients_lock = threading.Lock()


def _shared_client(s: ObjectStoreSettings, env: dict[str, str]) -> Any:
    """One botocore client per process, settings and AWS environment ``env`` (applied explicitly)."""
    key = (os.getpid(), s, tuple(sorted(env.items())))
    with _clients_lock:
        if key in _clients:
            return _clients[key]
        import botocore.config
        import botocore.session

        config = botocore.config.Config(
            connect_timeout=s.connect_timeout, read_timeout=s.read_timeout,
            retries={"total_max_attempts": 1},  # ours: logged, and per request
            max_pool_connections=max(s.upload_concurrency, s.read_concurrency) * 2 + 4,
            # the checkpoint carries its own xxh3 checksums: S3's CRCs only where required
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        session = botocore.session.Session()
        if "AWS_ACCESS_KEY_ID" in env and "AWS_SECRET_ACCESS_KEY" in env:
            session.set_credentials(env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"],
                                    env.get("AWS_SESSION_TOKEN"))
        if "AWS_PROFILE" in env:
            session.set_config_variable("profile", env["AWS_PROFILE"])
        region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
        if region:
            session.set_config_variable("region", region)
        client = _clients[key] = session.create_client("s3", endpoint_url=_endpoint(s, env), config=config)
        return client


_TRANSIENT_CODES = {
    "SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeoutException",
    "InternalError", "ServiceUnavailable", "RequestLimitExceeded", "TooManyRequestsException",
}


def _status(exc: Any) -> int:
    """The HTTP status of a botocore ``ClientError``."""
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)


def _code(exc: Any) -> str:
    """The S3 error code of a botocore ``ClientError``."""
    return str(exc.response.get("Error", {}).get("Code", ""))


def _transient(exc: BaseException) -> bool:
    import botocore.exceptions as bx
    import urllib3.exceptions as ux

    if isinstance(exc, bx.ClientError):
        return _status(exc) >= 500 or _status(exc) == 429 or _code(exc) in _TRANSIENT_CODES
    return isinstance(exc, (bx.HTTPClientError, bx.ConnectionError, bx.ResponseStreamingError,
                            bx.IncompleteReadError, ux.HTTPError, ConnectionError, TimeoutError, _ShortBody))


def _describe(exc: BaseException) -> str:
    import botocore.exceptions as bx

    if isinstance(exc, bx.ClientError):
        message = exc.response.get("Error", {}).get("Message", "")
        return f"HTTP {_status(exc) or '?'} {_code(exc)}: {message}".rstrip(": ")
    return f"{type(exc).__name__}: {exc}"


class _ShortBody(Exception):
    """A response body ended before its length (the connection was cut)."""


class ObjectStore:
    """One bucket's client: the requests a checkpoint needs, each retried when transient.
    Thread-safe; picklable (each process builds its own client on first use)."""

    def __init__(self, bucket: str, settings: Optional[ObjectStoreSettings] = None, scheme: str = "s3") -> None:
        self.bucket = bucket
        self.scheme = scheme
        self.settings = settings or ObjectStoreSettings()
        self._client: Any = None
        self._pid = -1
        self._env: Optional[dict[str, str]] = None  # None: this process's environment

    def _environment(self) -> dict[str, str]:
        return self._env if self._env is not None else {k: os.environ[k] for k in _AWS_ENV if k in os.environ}

    def __getstate__(self) -> dict[str, Any]:
        # the AWS environment travels with the store: the async writer may have started first
        return {"bucket": self.bucket, "scheme": self.scheme, "settings": self.settings, "env": self._environment()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["bucket"], state["settings"], state["scheme"])  # type: ignore[misc]
        self._env = state.get("env")

    def url(self, key: str) -> str:
        return f"{self.scheme}://{self.bucket}/{key}"

    @property
    def client(self) -> Any:
        if self._client is None or self._pid != os.getpid():
            self._client = _shared_client(self.settings, self._environment())
            self._pid = os.getpid()
        return self._client

    def _call(self, op: str, key: str, fn: Callable[[], T], expected: tuple[int, ...] = (), otherwise: Any = None
              ) -> T:
        """Run ``fn``, retrying transient errors; an HTTP status in ``expected`` returns ``otherwise``."""
        import botocore.exceptions as bx

        configure_from_env()
        s = self.settings
        attempt = 1
        while True:
            try:
                return fn()
            except Exception as exc:  # noqa: BLE001 - classified below
                if isinstance(exc, ObjectStoreError):
                    raise
                if isinstance(exc, bx.ClientError) and _status(exc) in expected:
                    return otherwise  # type: ignore[no-any-return]
                if not _transient(exc) or attempt >= s.max_attempts:
                    raise self._error(op, key, exc, attempt) from exc
                delay = min(s.backoff_max, s.backoff_base * 2 ** (attempt - 1)) * (0.5 + random.random() / 2)
                logger.info("%s %s failed (%s); retry %d/%d in %.2f s", op, self.url(key), _describe(exc),
                            attempt, s.max_attempts - 1, delay)
                time.sleep(delay)
                attempt += 1

    def _error(self, op: str, key: str, exc: BaseException, attempts: int) -> Exception:
        import botocore.exceptions as bx

        where = f"{op} {self.url(key)} (bucket {self.bucket!r}, key {key!r})"
        if isinstance(exc, bx.ClientError):
            code = _code(exc)
            if code in ("NoSuchKey", "404", "NotFound") and _status(exc) == 404:
                return CheckpointNotFoundError(f"{where}: no such object")
            hint = {
                "NoSuchBucket": f"bucket {self.bucket!r} does not exist",
                "InvalidAccessKeyId": "the access key is not known to the server (check AWS_ACCESS_KEY_ID)",
                "SignatureDoesNotMatch": "the secret key is wrong (check AWS_SECRET_ACCESS_KEY)",
                "AccessDenied": "access denied by the server's policy",
                "403": "access denied (bad credentials or policy)",
            }.get(code, "")
            detail = _describe(exc) + (f" — {hint}" if hint else "")
        else:
            endpoint = _endpoint(self.settings, self._environment()) or "the default AWS endpoint"
            detail = f"{_describe(exc)} (endpoint {endpoint})"
            if isinstance(exc, bx.NoCredentialsError):
                detail += (" — set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT_URL for a "
                           "local server), see docs/object-storage.md")
        tries = f" after {attempts} attempts" if attempts > 1 else ""
        return ObjectStoreError(f"{where} failed{tries}: {detail}")

    def put(self, key: str, data: Any) -> None:
        """One PUT of ``data`` (bytes-like) to ``key``."""
        self._call("PUT", key, lambda: self.client.put_object(Bucket=self.bucket, Key=key, Body=data))

    def put_if(self, key: str, data: bytes, *, absent: bool = False, etag: Optional[str] = None) -> Optional[str]:
        """A PUT only when ``key`` is ``absent`` (``If-None-Match: *``) or still has ``etag``
        (``If-Match``); the new ETag, ``None`` when the condition failed (412, or 409)."""
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": key, "Body": data}
        if absent:
            kwargs["IfNoneMatch"] = "*"
        if etag is not None:
            kwargs["IfMatch"] = etag
        failed = (412, 409, 404) if etag is not None else (412, 409)
        return self._call("PUT", key, lambda: str(self.client.put_object(**kwargs)["ETag"]), failed)

    def delete_if(self, key: str, etag: str) -> bool:
        """Delete ``key`` only while it has ``etag`` (``If-Match``); False when it changed or is gone."""
        def run() -> bool:
            self.client.delete_object(Bucket=self.bucket, Key=key, IfMatch=etag)
            return True

        return self._call("DELETE", key, run, (412, 404, 409), False)

    def stat(self, key: str) -> Optional[tuple[int, float, str]]:
        """``(size, last-modified epoch seconds, ETag)`` of ``key``, or None when it does not exist."""
        def head() -> Optional[tuple[int, float, str]]:
            resp = self.client.head_object(Bucket=self.bucket, Key=key)
            return int(resp["ContentLength"]), resp["LastModified"].timestamp(), str(resp["ETag"])

        return self._call("HEAD", key, head, (404,))

    def get(self, key: str) -> bytes:
        """The whole object; :class:`CheckpointNotFoundError` when it does not exist."""
        def fetch() -> bytes:
            resp = self.client.get_object(Bucket=self.bucket, Key=key)
            data = resp["Body"].read()
            if len(data) != resp["ContentLength"]:
                raise _ShortBody(f"{len(data)} of {resp['ContentLength']} bytes")
            return data

        return self._call("GET", key, fetch)

    def get_range_into(self, key: str, start: int, dest: memoryview) -> int:
        """Fill ``dest`` with the object's bytes ``[start, start + len(dest))``; returns the
        object's total size (from ``Content-Range``).  A short object is an error."""
        n = len(dest)

        def fetch() -> int:
            resp = self.client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes={start}-{start + n - 1}")
            body = resp["Body"]
            total = int(resp.get("ContentRange", "/-1").rsplit("/", 1)[-1] or -1)
            if resp["ContentLength"] != n:
                body.close()
                raise ObjectStoreError(f"GET {self.url(key)} bytes [{start}, {start + n}): the object has "
                                       f"{total} bytes (truncated or replaced)")
            # urllib3's readinto, straight into the destination: one copy less per byte
            raw = getattr(body, "_raw_stream", None)
            got = 0
            try:
                if raw is not None and hasattr(raw, "readinto"):
                    while got < n:
                        k = raw.readinto(dest[got:])
                        if not k:
                            break
                        got += k
                else:
                    for piece in body.iter_chunks(1 << 20):
                        dest[got:got + len(piece)] = piece
                        got += len(piece)
            finally:
                body.close()
            if got != n:
                raise _ShortBody(f"{got} of {n} bytes")
            return total

        return self._call("GET", key, fetch)

    def size(self, key: str) -> Optional[int]:
        """The object's size, or None when it does not exist (errors for a missing bucket)."""
        found = self.stat(key)
        if found is None:  # HEAD has no body: tell a missing key from a missing bucket
            self._call("HEAD", key, lambda: self.client.head_bucket(Bucket=self.bucket))
            return None
        return found[0]

    def list_objects(self, prefix: str, delimiter: Optional[str] = None) -> Iterator[tuple[str, int]]:
        """``(key, size)`` of the objects under ``prefix`` (with ``delimiter``: this level
        only; sub-prefixes are yielded as ``(prefix, -1)``)."""
        return ((key, size) for key, size, _ in self.list_modified(prefix, delimiter))

    def list_modified(self, prefix: str, delimiter: Optional[str] = None) -> Iterator[tuple[str, int, float]]:
        """As :meth:`list_objects`, with each object's last-modified time (epoch seconds;
        ``0.0`` for a sub-prefix)."""
        token: Optional[str] = None
        while True:
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix}
            if delimiter:
                kwargs["Delimiter"] = delimiter
            if token:
                kwargs["ContinuationToken"] = token
            page: dict[str, Any] = self._call("LIST", prefix, functools.partial(self.client.list_objects_v2, **kwargs))
            for entry in page.get("Contents", []):
                yield entry["Key"], int(entry["Size"]), entry["LastModified"].timestamp()
            for entry in page.get("CommonPrefixes", []):
                yield entry["Prefix"], -1, 0.0
            if not page.get("IsTruncated"):
                return
            token = page["NextContinuationToken"]

    def delete(self, keys: list[str]) -> None:
        """Delete ``keys`` (missing ones are fine), 1000 per request; no request for none."""
        for i in range(0, len(keys), 1000):
            batch = keys[i:i + 1000]

            def run(batch: list[str] = batch) -> None:
                resp = self.client.delete_objects(Bucket=self.bucket,
                                                  Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True})
                errors = resp.get("Errors") or []
                if errors:
                    first = errors[0]
                    raise ObjectStoreError(f"DELETE {self.url(first.get('Key', ''))} failed: "
                                           f"{first.get('Code')}: {first.get('Message')}")

            self._call("DELETE", batch[0], run)

    def abort_uploads(self, prefix: str) -> int:
        """Abort the unfinished multipart uploads under ``prefix``; returns how many."""
        resp = self._call("LIST-UPLOADS", prefix,
                          lambda: self.client.list_multipart_uploads(Bucket=self.bucket, Prefix=prefix))
        uploads = resp.get("Uploads", [])
        for up in uploads:
            self.abort_upload(up["Key"], up["UploadId"])
        return len(uploads)

    def start_upload(self, key: str) -> str:
        return self._call("CREATE-MULTIPART", key,
                          lambda: self.client.create_multipart_upload(Bucket=self.bucket, Key=key)["UploadId"])

    def upload_part(self, key: str, upload_id: str, number: int, data: Any) -> str:
        return self._call(f"PUT-PART {number}", key, lambda: self.client.upload_part(
            Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=data)["ETag"])

    def complete_upload(self, key: str, upload_id: str, etags: list[str]) -> None:
        parts = [{"ETag": e, "PartNumber": i + 1} for i, e in enumerate(etags)]
        self._call("COMPLETE-MULTIPART", key, lambda: self.client.complete_multipart_upload(
            Bucket=self.bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}))

    def abort_upload(self, key: str, upload_id: str) -> None:
        import botocore.exceptions as bx

        try:
            self._call("ABORT-MULTIPART", key, lambda: self.client.abort_multipart_upload(
                Bucket=self.bucket, Key=key, UploadId=upload_id))
        except ObjectStoreError as exc:
            if not isinstance(exc.__cause__, bx.ClientError):
                raise
            # NoSuchUpload: already completed or aborted
