"""A real S3-compatible server on loopback for the object-storage tests: moto's server mode
(`moto[server]`), spoken to over HTTP by the ordinary clients (s3fs, boto3), configured the standard
way: `AWS_ENDPOINT_URL` and credentials in the environment, which subprocesses inherit.

The server runs in a thread of the test process and logs every request it answers through the
`werkzeug` logger; `S3Server.requests` reads that log, so a test can count the GETs of an object."""

from __future__ import annotations

import logging
import re
import uuid

from moto.server import ThreadedMotoServer

_REQUEST = re.compile(r'"(?P<method>[A-Z]+) (?P<path>\S+) HTTP/[0-9.]+" (?P<status>\d+)')
_COLOUR = re.compile(r"\x1b\[[0-9;]*m")  # werkzeug colours some lines (206 partial content, 4xx)


class _RequestLog(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class S3Server:
    """moto's S3 server on 127.0.0.1 at a free port."""

    def __init__(self) -> None:
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=True)
        self._log = _RequestLog()

    def start(self) -> None:
        self._server.start()
        logger = logging.getLogger("werkzeug")
        logger.addHandler(self._log)
        logger.setLevel(logging.INFO)

    def stop(self) -> None:
        logging.getLogger("werkzeug").removeHandler(self._log)
        self._server.stop()

    @property
    def endpoint(self) -> str:
        host, port = self._server.get_host_and_port()
        return f"http://{host}:{port}"

    @property
    def environment(self) -> dict[str, str]:
        """What a client needs to reach this server: the standard AWS variables."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def new_bucket(self) -> str:
        """Create an empty bucket with a fresh name; returns its name."""
        import boto3

        name = f"prepack-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=self.endpoint).create_bucket(Bucket=name)
        return name

    def requests(self, method: str, path_prefix: str) -> list[str]:
        """The paths of the requests of `method` answered so far whose path starts with `path_prefix`
        ('/BUCKET/KEY')."""
        found = (_REQUEST.search(_COLOUR.sub("", line)) for line in list(self._log.lines))
        return [m["path"] for m in found if m and m["method"] == method and m["path"].startswith(path_prefix)]
