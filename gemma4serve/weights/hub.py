"""Resolve `--model` / `--draft` to a local checkpoint directory."""

from __future__ import annotations

from pathlib import Path

# What a text server needs from a repo: configs, weights, tokenizer, chat template. Not the README
# images, not the original (non-HF) weight formats some repos also carry.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.jinja"]


class CheckpointNotFoundError(FileNotFoundError):
    pass


def _looks_like_path(model: str) -> bool:
    # A Hub id is "name" or "org/name"; anything else with path syntax means a local directory.
    return model.startswith(("/", "./", "../", "~")) or model.count("/") > 1 or "\\" in model


def resolve_checkpoint(
    model: str, revision: str | None = None, *, cache_dir: str | Path | None = None
) -> Path:
    """The local checkpoint directory for `model`, a directory or a Hugging Face repo id.

    A local directory is used as is; a repo id is fetched into (or, with HF_HUB_OFFLINE=1, found
    in) the HF cache with `snapshot_download`.
    """
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise CheckpointNotFoundError(
                f"{path} is a directory but has no config.json: not a checkpoint"
            )
        return path
    if path.exists():
        raise CheckpointNotFoundError(
            f"{path} is a file; --model wants a checkpoint directory or a Hub repo id"
        )
    if _looks_like_path(model):
        raise CheckpointNotFoundError(f"no such checkpoint directory: {path}")

    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{model}" + (f"@{revision}" if revision else "")
    try:
        local = snapshot_download(
            repo_id=model,
            revision=revision,
            allow_patterns=ALLOW_PATTERNS,
            cache_dir=str(cache_dir) if cache_dir else None,
        )
    except GatedRepoError as e:
        raise CheckpointNotFoundError(
            f"{where} is gated: accept its license on huggingface.co and log in "
            "(`hf auth login` or HF_TOKEN)"
        ) from e
    except RevisionNotFoundError as e:
        raise CheckpointNotFoundError(f"{where}: revision {revision!r} not found on the Hub") from e
    except RepositoryNotFoundError as e:
        raise CheckpointNotFoundError(
            f"{where}: no such local directory, and no such repository on the Hub "
            "(or it is private: log in)"
        ) from e
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as e:
        offline = (
            " (HF_HUB_OFFLINE is set)"
            if constants.HF_HUB_OFFLINE
            else " and the Hub cannot be reached"
        )
        raise CheckpointNotFoundError(
            f"{where}: no such local directory, not in the Hugging Face cache{offline}"
        ) from e
    except HFValidationError as e:
        raise CheckpointNotFoundError(
            f"{model!r} is neither a local directory nor a valid Hub repo id: {e}"
        ) from e
    except HfHubHTTPError as e:
        raise CheckpointNotFoundError(f"{where}: download failed: {e}") from e
    local = Path(local)
    if not (local / "config.json").exists():
        raise CheckpointNotFoundError(f"{where} has no config.json: not a transformers checkpoint")
    return local
