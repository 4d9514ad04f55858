"""POST /v1/files' multipart body, parsed as it arrives: the `file` part goes straight to its
file on disk (front/batches/files.py `Upload`), never whole into memory, and a body that is not
the form it must be is a 400 `invalid_upload` naming what is wrong, never a 500.

The form is `file` (the bytes) and `purpose` (a short text), in any order; at most
`MAX_PARTS` parts, each with a head of at most `MAX_PART_HEAD_BYTES` in `MAX_PART_HEADERS`
header lines (python-multipart enforces those two as it parses).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from modelyard.front.batches.errors import InvalidUpload
from modelyard.front.batches.files import FileStore, Upload

MAX_PARTS = 4  # file, purpose, and room for a client's harmless extra field
MAX_PART_HEADERS = 8
MAX_PART_HEAD_BYTES = 4096  # one header line; a filename longer than this is no filename
MAX_FIELD_BYTES = 1024  # `purpose` and any other text field


@dataclass
class _Part:
    name: str = ""
    filename: str | None = None
    data: bytearray = field(default_factory=bytearray)  # text fields only


@dataclass
class Form:
    purpose: str | None
    filename: str
    upload: Upload  # the caller commits or discards it


def boundary_of(content_type: str) -> bytes:
    kind, options = parse_options_header(content_type)
    if kind != b"multipart/form-data":
        raise InvalidUpload("send multipart/form-data with `file` and `purpose`", param="file")
    boundary = options.get(b"boundary")
    if not boundary or len(boundary) > 70:  # RFC 2046: 1 to 70 characters
        raise InvalidUpload("the multipart Content-Type has no boundary (or one over 70 "
                            "characters); let your HTTP client build the form", param="file")
    return boundary


class _Parser:
    """python-multipart's callbacks: a part's head decides where its data goes."""

    def __init__(self, boundary: bytes) -> None:
        self.parts = 0
        self.part = _Part()
        self.head: list[tuple[bytes, bytes]] = []
        self.field, self.value = b"", b""
        self.fields: dict[str, str] = {}
        self.filename: str | None = None
        self.file_chunks: list[bytes] = []  # of the bytes fed last: written out by the caller
        self.has_file = False
        self.ended = False
        self.parser = MultipartParser(boundary, {
            "on_part_begin": self._part_begin, "on_header_field": self._header_field,
            "on_header_value": self._header_value, "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished, "on_part_data": self._data,
            "on_part_end": self._part_end, "on_end": self._end,
        }, max_header_count=MAX_PART_HEADERS, max_header_size=MAX_PART_HEAD_BYTES)

    def feed(self, chunk: bytes) -> None:
        try:
            self.parser.write(chunk)
        except MultipartParseError as exc:
            raise InvalidUpload(f"the multipart body is malformed: {exc}", param="file") from None

    def _part_begin(self) -> None:
        self.parts += 1
        if self.parts > MAX_PARTS:
            raise InvalidUpload(f"the form has over {MAX_PARTS} parts; send `file` and "
                                "`purpose`", param="file")
        self.part, self.head = _Part(), []

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self.field += data[start:end]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self.value += data[start:end]

    def _header_end(self) -> None:
        self.head.append((self.field.lower(), self.value))
        self.field, self.value = b"", b""

    def _headers_finished(self) -> None:
        disposition = dict(self.head).get(b"content-disposition")
        kind, options = parse_options_header(disposition)
        if kind != b"form-data" or b"name" not in options:
            raise InvalidUpload("a form part has no Content-Disposition: form-data; name=…",
                                param="file")
        self.part.name = options[b"name"].decode("utf-8", "replace")
        if self.part.name == "file":
            if self.has_file:
                raise InvalidUpload("the form has two `file` parts; send one file per upload",
                                    param="file")
            self.has_file = True
            raw = options.get(b"filename")
            self.filename = raw.decode("utf-8", "replace") if raw else None
        elif self.part.name in self.fields:
            raise InvalidUpload(f"the form has two {self.part.name!r} parts",
                                param=self.part.name)

    def _data(self, data: bytes, start: int, end: int) -> None:
        if self.part.name == "file":
            self.file_chunks.append(data[start:end])
            return
        self.part.data += data[start:end]
        if len(self.part.data) > MAX_FIELD_BYTES:
            raise InvalidUpload(f"the form field {self.part.name!r} is over {MAX_FIELD_BYTES} "
                                "bytes", param=self.part.name)

    def _part_end(self) -> None:
        if self.part.name != "file":
            self.fields[self.part.name] = self.part.data.decode("utf-8", "replace")

    def _end(self) -> None:
        self.ended = True


async def receive_upload(files: FileStore, owner: str, content_type: str,
                         body: AsyncIterator[bytes]) -> Form:
    """Parse the form while writing its `file` part to a new upload of `owner`'s; the upload
    is discarded if anything goes wrong (a bad form, a limit, a full disk, a client gone)."""
    parser = _Parser(boundary_of(content_type))
    upload = await asyncio.to_thread(files.upload, owner)
    try:
        async for chunk in body:
            parser.feed(chunk)
            if parser.file_chunks:
                data = b"".join(parser.file_chunks)
                parser.file_chunks.clear()
                await asyncio.to_thread(upload.write, data)
        if not parser.ended:
            raise InvalidUpload("the multipart body ends before its closing boundary",
                                param="file")
        if not parser.has_file:
            raise InvalidUpload("a `file` part is required", param="file")
        return Form(parser.fields.get("purpose"), parser.filename or "upload.jsonl", upload)
    except BaseException:
        await asyncio.to_thread(upload.discard)
        raise
