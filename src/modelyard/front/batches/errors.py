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
