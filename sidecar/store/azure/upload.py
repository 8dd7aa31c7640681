"""One conditional upload of a blob: a Put Blob, or staged blocks and one Put Block List,
conditional on an ETag (``If-Match``) or on the blob's absence (``If-None-Match: *``), with its
Content-MD5; a failed condition is :class:`Conflict`, however the service says it. What to write,
and when to read the blob again, is the store's rule (:meth:`AzureBlobStore.put
<sidecar.store.azure.store.AzureBlobStore.put>`).
"""

from __future__ import annotations

import base64
import os
from typing import Any

from azure.core import MatchConditions
from azure.core.exceptions import HttpResponseError, ResourceExistsError, ResourceModifiedError
from azure.storage.blob import ContentSettings

from sidecar.store.azure.errors import error_code
from sidecar.store.base import CHUNK_BYTES, Source


class Conflict(Exception):
    """A conditional write found the blob changed (412) or present (409 BlobAlreadyExists)."""


async def put_blob(blob: Any, data: bytes | Source, md5: bytes, metadata: dict[str, str],
                   etag: str | None, staged: bool = False) -> str | None:
    """Upload one blob, conditional on ``etag`` (``If-Match``) or on its absence
    (``If-None-Match: *``); returns the new ETag, raises :class:`Conflict` when the
    condition fails. ``md5`` is recorded as the blob's Content-MD5; the SDK sends the
    transactional Content-MD5 of each request (``validate_content``), which the service checks.
    ``staged``: bytes go up as staged blocks and one conditional Put Block List instead of a
    Put Blob (see :func:`commit_blocks`)."""
    condition: dict[str, Any] = ({"etag": etag, "match_condition": MatchConditions.IfNotModified} if etag
                                 else {"match_condition": MatchConditions.IfMissing})
    if staged and isinstance(data, bytes):
        return await commit_blocks(blob, data, md5, metadata, condition)
    try:
        # a Source is streamed in blocks and committed only after its last chunk checked out
        body, length = (data, len(data)) if isinstance(data, bytes) else (data.chunks(), data.size)
        response = await blob.upload_blob(
            body, length=length, overwrite=True, metadata=metadata, validate_content=True,
            content_settings=ContentSettings(content_type="application/octet-stream", content_md5=bytearray(md5)),
            max_concurrency=4 if isinstance(data, bytes) else 1, **condition,
        )
    except ResourceModifiedError:
        raise Conflict() from None  # 412: someone else wrote it
    except ResourceExistsError as e:
        if error_code(e) != "BlobAlreadyExists":
            raise
        raise Conflict() from None  # 409: someone else made it
    except HttpResponseError as e:
        if error_code(e) != "InvalidBlockList":
            raise
        raise Conflict() from None  # another writer committed while we staged blocks
    return response.get("etag")


async def commit_blocks(blob: Any, data: bytes, md5: bytes, metadata: dict[str, str],
                         condition: dict[str, Any]) -> str | None:
    """Write ``data`` as staged blocks and one conditional Put Block List, which replaces
    whatever uncommitted blocks the blob holds. For a blob that holds only the uncommitted
    blocks of a dead upload (a sidecar killed while streaming): Azure counts it as absent,
    but Azurite answers a Put Blob with ``If-None-Match: *`` there with 409
    ``BlobAlreadyExists``, while its Put Block List honours the condition. The new block ids
    take the length of the ones already staged (the service requires one length per blob)."""
    try:
        _, uncommitted = await blob.get_block_list("uncommitted")
        width = len(uncommitted[0].id) if uncommitted else 0
        if not (width and width % 4 == 0 and 8 <= width <= 88):  # base64 of 6..64 bytes
            width = 64  # the SDK's own: base64 of 48 digits
        ids: list[str] = []
        view = memoryview(data)
        for start in range(0, len(data), CHUNK_BYTES):
            ids.append(base64.b64encode(os.urandom(width * 3 // 4)).decode())
            piece = view[start:start + CHUNK_BYTES]
            await blob.stage_block(ids[-1], bytes(piece), length=len(piece), validate_content=True)
        response = await blob.commit_block_list(
            ids, metadata=metadata,
            content_settings=ContentSettings(content_type="application/octet-stream", content_md5=bytearray(md5)),
            **condition,
        )
    except ResourceModifiedError:
        raise Conflict() from None
    except ResourceExistsError as e:
        if error_code(e) != "BlobAlreadyExists":
            raise
        raise Conflict() from None  # committed by another writer meanwhile
    except HttpResponseError as e:
        if error_code(e) not in ("InvalidBlockList", "InvalidBlobOrBlock"):
            raise
        raise Conflict() from None  # another writer's blocks replaced ours meanwhile
    return response.get("etag")
