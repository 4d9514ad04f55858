"""The batch API's error codes (docs/troubleshooting.md lists them)."""

from __future__ import annotations

from modelyard.errors import Conflict, InvalidRequest, ModelyardError


class FileNotFound(ModelyardError):
    status = 404
    code = "file_not_found"
    openai_type = "invalid_request_error"

    def __init__(self, file_id: str) -> None:
        super().__init__(f"no file {file_id!r} (or it is not yours); GET /v1/files lists yours",
                         param="file_id")


class BatchNotFound(ModelyardError):
    status = 404
    code = "batch_not_found"
    openai_type = "invalid_request_error"

    def __init__(self, batch_id: str) -> None:
        super().__init__(f"no batch {batch_id!r} (or it is not yours); GET /v1/batches lists "
                         "yours", param="batch_id")


class InvalidBatchFile(InvalidRequest):
    """A batch input that is not what the batch API runs: the message names the line."""

    code = "invalid_batch_file"


class BatchFinished(Conflict):
    code = "batch_finished"


class FilesOverQuota(ModelyardError):
    """413: an upload would take its owner's files over `files_max_total_bytes_per_owner`.
    A 413, not a 429: waiting does not help, deleting files does (the body is what does not
    fit)."""

    status = 413
    code = "files_over_quota"
    openai_type = "invalid_request_error"


class TooManyOpenBatches(ModelyardError):
    """429: the owner already has `batches_max_open_per_owner` batches not yet ended. A 429:
    waiting helps (a batch that ends frees its place), as for a rate limit."""

    status = 429
    code = "too_many_open_batches"
    openai_type = "rate_limit_error"


class InvalidUpload(InvalidRequest):
    """A POST /v1/files body that is not the multipart form it must be (no boundary, a
    repeated or missing part, too many parts, an oversized part head, broken framing)."""

    code = "invalid_upload"
