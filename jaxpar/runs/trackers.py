"""Where a run's metrics go besides ``metrics.jsonl``: TensorBoard and Weights & Biases.

``train.trackers`` names them (default ``[tensorboard]``). Each receives every logged row
(the scalars of :func:`jaxpar.runs.monitor.tensorboard_tags`) at its step.

Weights & Biases runs through its own library: the run config is the W&B config (with the
mesh and device count the run resolved), the run's id is kept in ``OUT/wandb-id`` so a
``--resume`` continues the same W&B run, and the files go under ``OUT/wandb``. Its mode and
project come from W&B's environment (``WANDB_MODE=offline`` writes locally, for machines
without a network; ``WANDB_PROJECT``, default ``jaxpar``).

:func:`check_wandb` runs before the run starts, so a run that could not reach W&B fails in
one line with nothing written, rather than after its first compile (or after minutes of
W&B's retries): an unknown ``WANDB_MODE``, an online run without credentials
(``WANDB_API_KEY``, ``wandb login``), or a W&B server that does not answer within
:data:`PROBE_TIMEOUT_S`. jaxpar does not fall back to offline by itself: metrics that never
reach the dashboard someone is watching would be a silent surprise; the message says to
set ``WANDB_MODE=offline`` (and ``wandb sync`` the run later).
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from jaxpar.errors import JaxparError

MODES = ("online", "offline", "disabled", "dryrun", "run", "shared")
"""The values W&B takes in ``WANDB_MODE`` (``dryrun`` is an old name of ``offline``)."""

LOCAL_MODES = ("offline", "disabled", "dryrun")
"""Modes that need no server."""

PROBE_TIMEOUT_S = 5.0
"""How long :func:`check_wandb` waits for the W&B server to accept a connection."""

OFFLINE_HINT = "or set WANDB_MODE=offline to log locally (wandb sync uploads it later)"


def _base_url() -> str:
    url = os.environ.get("WANDB_BASE_URL", "").strip()
    if url:
        return url.rstrip("/")
    try:
        from wandb.sdk.lib.urls import DEFAULT_BASE_URL
    except ImportError:  # another W&B version
        return "https://api.wandb.ai"
    return DEFAULT_BASE_URL


def _has_credentials(url: str) -> bool:
    """Whether W&B would find credentials for ``url`` (its environment, ``.netrc`` or
    settings), asking W&B's own lookup where this version has it.

    Raises:
      JaxparError: for credentials W&B finds but refuses (a malformed key).
    """
    try:
        from wandb.sdk.lib.wbauth import authenticate
        from wandb.sdk.lib.wbauth.host_url import HostUrl

        auth = authenticate._use_system_auth(host=HostUrl(url), source="jaxpar",
                                             update_session=False)
        return auth is not None
    except (ImportError, AttributeError, TypeError):  # another W&B version: the .netrc
        import netrc

        if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
            return True
        try:
            return netrc.netrc().authenticators(urlsplit(url).hostname or "") is not None
        except (OSError, netrc.NetrcParseError):
            return False
    except Exception as err:  # noqa: BLE001 - W&B's AuthenticationError, one line
        text = (str(err) or type(err).__name__).splitlines()[0]
        raise JaxparError(f"train.trackers: wandb refuses its credentials ({text}): fix "
                          f"WANDB_API_KEY or run wandb login, {OFFLINE_HINT}") from None


def check_wandb() -> None:
    """Refuse, in one line and before the run starts, a W&B set-up that cannot log: an
    unknown ``WANDB_MODE``; online without credentials; a server that does not accept a
    connection within :data:`PROBE_TIMEOUT_S`.

    Raises:
      JaxparError: naming the setting and the fix.
    """
    mode = os.environ.get("WANDB_MODE", "").strip()
    if mode and mode not in MODES:
        raise JaxparError(f"WANDB_MODE={mode!r} is not a W&B mode: use one of "
                          f"{', '.join(MODES[:3])} (train.trackers has wandb)")
    if mode in LOCAL_MODES or os.environ.get("WANDB_DISABLED", "").lower() in ("1", "true"):
        return
    url = _base_url()
    if not _has_credentials(url):
        raise JaxparError(f"train.trackers has wandb, but W&B has no API key for {url}: set "
                          f"WANDB_API_KEY or run wandb login, {OFFLINE_HINT}")
    reason = _unreachable(url)
    if reason is not None:
        raise JaxparError(f"train.trackers has wandb, but the W&B server {url} cannot be "
                          f"reached ({reason}): check the network or WANDB_BASE_URL, "
                          f"{OFFLINE_HINT}")


def _unreachable(url: str) -> str | None:
    """Why ``url``'s host does not accept a connection within :data:`PROBE_TIMEOUT_S`
    (name lookup included, which a socket timeout does not bound), or None."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    result: list[str | None] = []

    def probe() -> None:
        try:
            socket.create_connection((parts.hostname or "", port),
                                     timeout=PROBE_TIMEOUT_S).close()
            result.append(None)
        except OSError as err:
            result.append(f"no answer within {PROBE_TIMEOUT_S:.0f} s"
                          if isinstance(err, TimeoutError)
                          else (err.strerror or type(err).__name__).lower())

    worker = threading.Thread(target=probe, name="jaxpar-wandb-probe", daemon=True)
    worker.start()
    worker.join(PROBE_TIMEOUT_S + 0.5)
    return result[0] if result else f"no answer within {PROBE_TIMEOUT_S:.0f} s"


class WandbTracker:
    """One W&B run per run folder, continued on resume.

    Args:
      out: the run folder.
      config: the run config as a dict (logged as the W&B config).
      summary: figures known at the start (the layout, the planner's prediction) for the
        run's summary.
      resumed: whether this is a ``--resume`` of the run in ``out``.
    """

    def __init__(self, out: Path, config: dict[str, Any], summary: dict[str, Any],
                 resumed: bool):
        import wandb

        id_file = out / "wandb-id"
        new = [p for p in (id_file, out / "wandb") if not p.exists()]
        run_id = id_file.read_text().strip() if resumed and id_file.is_file() else (
            secrets.token_hex(4))
        id_file.write_text(run_id)
        (out / "wandb").mkdir(parents=True, exist_ok=True)
        try:
            self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "jaxpar"),
                                  name=out.name, id=run_id, resume="allow", dir=str(out),
                                  config=config, reinit="create_new")
        except Exception as err:  # noqa: BLE001 - W&B's errors are many and long
            for path in new:  # what this tracker made, so the folder is as it was
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink()
            text = (str(err) or type(err).__name__).strip().splitlines()[0]
            raise JaxparError(f"train.trackers: wandb could not start its run "
                              f"({type(err).__name__}: {text}); {OFFLINE_HINT}") from None
        self.run.summary.update(summary)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        """Log one row's scalars at ``step``."""
        self.run.log(values, step=step)

    def close(self) -> None:
        """Finish the W&B run (offline: its files are complete on disk)."""
        self.run.finish()
