"""``qaccel push``: upload an exported model folder to the Hugging Face Hub (or a compatible endpoint).

Order, so that a failure leaves nothing half-uploaded:

1. check the folder (files, sizes, the card's front matter): this is also the ``dry_run`` plan,
   which sends nothing and needs neither a token nor a network;
2. refuse offline mode (``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``) and a missing token
   (argument, ``HF_TOKEN``, or the token stored by ``hf auth login`` under ``HF_HOME``);
3. ``whoami`` on the endpoint: an unreachable endpoint or a rejected token stops here, before
   any repository is created;
4. ``create_repo(exist_ok=True)``, ``create_branch`` for a ``revision``, then one ``upload_folder``
   (huggingface_hub sends a folder of at most 20 files and under 100 MB of small files as a single
   commit, so the files land together or not at all).

The token is never printed: every message that leaves this module has it replaced by ``***``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from .._settings import env_flag

__all__ = ["PushError", "push_folder", "plan_push"]

logger = logging.getLogger(__name__)

# upload_folder's own rule: at most this many files go as one commit, whatever happens.
_ONE_COMMIT_MAX_FILES = 20


class PushError(RuntimeError):
    """The push could not start or did not complete; the message says why (without the token)."""


def _redact(text: str, token: str | None) -> str:
    return text.replace(token, "***") if token else text


def _offline() -> bool:
    from huggingface_hub import constants

    env = any(env_flag(name) for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return env or constants.is_offline_mode()


def _files(folder: Path) -> list[dict[str, Any]]:
    entries = []
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        # upload_folder never sends these (huggingface_hub's DEFAULT_IGNORE_PATTERNS)
        if path.is_file() and not rel.startswith((".git/", ".cache/huggingface/")):
            entries.append({"path": rel, "size": path.stat().st_size})
    return entries


def plan_push(folder: str | os.PathLike, repo_id: str, *, private: bool = False, revision: str | None = None,
              commit_message: str | None = None, endpoint: str | None = None) -> dict:
    """What :func:`push_folder` would upload: files, sizes, the card's front matter; sends nothing.

    Raises:
        FileNotFoundError: ``folder`` does not exist.
        ValueError: an invalid ``repo_id``, an empty folder, no ``README.md``, more files than
            fit in one commit, or a card whose front matter does not parse.
    """
    from huggingface_hub import ModelCard, constants
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"push: {folder}: no such folder")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise ValueError(f"push repo_id={repo_id!r}: {err}") from None
    if "/" not in repo_id:
        raise ValueError(f"push repo_id={repo_id!r}: expected ORG/NAME (the namespace is required)")
    files = _files(folder)
    if not files:
        raise ValueError(f"push: {folder} is empty")
    if len(files) > _ONE_COMMIT_MAX_FILES:
        raise ValueError(
            f"push: {folder} holds {len(files)} files; at most {_ONE_COMMIT_MAX_FILES} are pushed, so that they "
            "land in one commit (export writes about ten)"
        )
    card_path = folder / "README.md"
    if not card_path.is_file():
        raise ValueError(f"push: {folder} has no README.md model card (qaccel export writes one)")
    try:
        front_matter = ModelCard.load(card_path).data.to_dict()
    except Exception as err:  # noqa: BLE001 - yaml errors of any kind
        raise ValueError(f"push: {card_path}: the card's front matter does not parse ({err})") from None
    return {
        "repo_id": repo_id,
        "endpoint": (endpoint or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/"),
        "revision": revision or "main",
        "private": private,
        "commit_message": commit_message or f"Upload {folder.name} with qaccel",
        "files": files,
        "total_bytes": sum(entry["size"] for entry in files),
        "card": front_matter,
    }


def _resolve_token(token: str | None) -> str | None:
    if token:
        return token
    from huggingface_hub import get_token

    return get_token()


def push_folder(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
    dry_run: bool = False,
    token: str | None = None,
    endpoint: str | None = None,
) -> dict:
    """Upload ``folder`` (an export) to ``repo_id`` in one commit; or, with ``dry_run``, return the plan.

    Args:
        folder: the exported model folder (``qaccel export``).
        repo_id: ``ORG/NAME``.
        private: create the repository private (an existing repository keeps its visibility).
        revision: a branch to commit to (created from ``main`` when missing); default ``main``.
        commit_message: default ``Upload <folder name> with qaccel``.
        dry_run: return the plan (files, sizes, card front matter) and send nothing.
        token: default ``HF_TOKEN``, then the token stored by ``hf auth login``.
        endpoint: default ``HF_ENDPOINT``, then huggingface.co.

    Returns:
        The plan (see :func:`plan_push`), with ``dry_run`` and, after an upload, ``url``,
        ``commit_url`` and ``commit_oid``.

    Raises:
        PushError: offline mode, no token, an unreachable endpoint, a rejected token, or an upload
            error (the message never contains the token).
        FileNotFoundError, ValueError: as :func:`plan_push`.
    """
    plan = plan_push(folder, repo_id, private=private, revision=revision, commit_message=commit_message, endpoint=endpoint)
    plan["dry_run"] = dry_run
    if dry_run:
        return plan
    if _offline():
        raise PushError("push: Hugging Face Hub offline mode is on (HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE); nothing was sent")
    token = _resolve_token(token)
    if not token:
        raise PushError("push: no Hugging Face token; set HF_TOKEN or run `hf auth login` (nothing was sent)")
    try:
        result = _upload(Path(folder), plan, token)
    except PushError:
        raise
    except Exception as err:  # noqa: BLE001 - huggingface_hub and httpx raise many kinds
        raise PushError(_redact(f"push to {plan['endpoint']} ({repo_id}) failed: {type(err).__name__}: {err}", token)) from None
    plan.update(result)
    return plan


def _upload(folder: Path, plan: dict, token: str) -> dict:
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi(endpoint=plan["endpoint"], token=token)
    try:
        api.whoami()
    except HfHubHTTPError as err:
        status = err.response.status_code if err.response is not None else None
        if status in (401, 403):
            raise PushError(f"push: {plan['endpoint']} rejected the token (HTTP {status}); nothing was sent") from None
        raise PushError(_redact(f"push: {plan['endpoint']} answered the token check with an error: {err}", token)) from None
    except Exception as err:  # noqa: BLE001 - connection refused, DNS, TLS, timeouts
        raise PushError(_redact(f"push: cannot reach {plan['endpoint']} ({type(err).__name__}: {err}); nothing was sent", token)) from None
    repo_url = api.create_repo(plan["repo_id"], private=plan["private"], exist_ok=True)
    if plan["revision"] != "main":
        api.create_branch(plan["repo_id"], branch=plan["revision"], exist_ok=True)
    logger.info("uploading %d files (%d bytes) to %s", len(plan["files"]), plan["total_bytes"], repo_url)
    info = api.upload_folder(
        repo_id=plan["repo_id"],
        folder_path=str(folder),
        commit_message=plan["commit_message"],
        revision=plan["revision"],
    )
    return {"url": str(repo_url), "commit_url": info.commit_url, "commit_oid": info.oid}
