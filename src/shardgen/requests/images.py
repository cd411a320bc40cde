"""Image cells (``prompt.images``) as the images a vision-language model's request carries.

A cell may hold the image's bytes (any format Pillow reads), a file path, or
a ``datasets`` ``Image`` feature as Parquet stores it (a ``{bytes, path}``
struct). The decoded images go to vLLM as the request's
``multi_modal_data={"image": [...]}``, one per column, in column order; the
prompt holds one image placeholder per column, where the model's chat
template puts it (``{"type": "image"}`` content parts). An image that does not
decode is a per-row error naming the column.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shardgen.errors import RowError


def decode(column: str, value: Any) -> Any:
    """The RGB ``PIL.Image`` of one cell.

    Raises:
        RowError: the cell is null, empty, or not an image Pillow can read (Pillow also refuses
            a decompression bomb: more than twice ``Image.MAX_IMAGE_PIXELS`` pixels).
    """
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Mapping):  # a datasets Image feature: {bytes, path}
        value = value.get("bytes") or value.get("path")
    if value is None or value == b"" or value == "":
        raise RowError("bad_image", f"column '{column}' has no image (null or empty)")
    try:
        source = io.BytesIO(value) if isinstance(value, bytes | bytearray) else Path(str(value))
        with Image.open(source) as img:
            return img.convert("RGB")
    except (OSError, UnidentifiedImageError, ValueError, Image.DecompressionBombError) as e:
        what = f"{str(value)[:120]!r}" if isinstance(value, str) else f"{len(value)} bytes"
        raise RowError("bad_image", f"column '{column}': {what} is not an image Pillow can read ({e})"[:500]) from None


def row_images(columns: tuple[str, ...], row: Mapping[str, Any]) -> list[Any]:
    """The row's images, one per column of ``prompt.images``.

    Raises:
        RowError: one does not decode.
    """
    return [decode(c, row.get(c)) for c in columns]
