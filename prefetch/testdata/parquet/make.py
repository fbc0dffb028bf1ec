"""Writes the Parquet files under this folder with pyarrow.

Made with pyarrow 26.0.1 (Python 3.11):

    python3 -m venv /tmp/pq && /tmp/pq/bin/pip install pyarrow==26.0.1
    /tmp/pq/bin/python prefetch/testdata/parquet/make.py prefetch/testdata/parquet

One file per compression and page version, 30 rows in row groups of 7,
with every kind of column ckptd delivers: numbers, strings and bytes,
nulls, lists and a struct. expected.json holds every row, in file and row
order, as {field: base64 of the bytes ckptd delivers}: a number little
endian, a string or bytes as they are, a list's values one after another
(strings each after a uint32 length), a null no field; a struct's leaves
are named by their dotted path.
"""

import base64
import json
import os
import struct
import sys

import pyarrow as pa
import pyarrow.parquet as pq

ROWS = 30


def table():
    return pa.table(
        {
            "id": pa.array([i * 11 - 40 for i in range(ROWS)], pa.int64()),
            "text": pa.array([f"row {i} " + "ü" * (i % 4) for i in range(ROWS)], pa.string()),
            "blob": pa.array([bytes((i + j) % 256 for j in range(i * 7 % 50)) for i in range(ROWS)], pa.binary()),
            "score": pa.array([i / 4 for i in range(ROWS)], pa.float32()),
            "flag": pa.array([i % 3 == 0 for i in range(ROWS)], pa.bool_()),
            "maybe": pa.array([None if i % 4 == 1 else i for i in range(ROWS)], pa.int32()),
            "tokens": pa.array([list(range(i % 6)) for i in range(ROWS)], pa.list_(pa.int32())),
            "tags": pa.array([[f"t{j}" for j in range(i % 3)] for i in range(ROWS)], pa.list_(pa.string())),
            "image": pa.array(
                [{"bytes": bytes([i]) * (i % 5), "path": f"img{i}.png"} for i in range(ROWS)],
                pa.struct([("bytes", pa.binary()), ("path", pa.string())]),
            ),
        }
    )


def expected():
    rows = []
    for i in range(ROWS):
        r = {
            "id": struct.pack("<q", i * 11 - 40),
            "text": (f"row {i} " + "ü" * (i % 4)).encode(),
            "blob": bytes((i + j) % 256 for j in range(i * 7 % 50)),
            "score": struct.pack("<f", i / 4),
            "flag": bytes([i % 3 == 0]),
            "tokens": b"".join(struct.pack("<i", j) for j in range(i % 6)),
            "tags": b"".join(struct.pack("<I", len(f"t{j}")) + f"t{j}".encode() for j in range(i % 3)),
            "image.bytes": bytes([i]) * (i % 5),
            "image.path": f"img{i}.png".encode(),
        }
        if i % 4 != 1:
            r["maybe"] = struct.pack("<i", i)
        # an empty list is no value, as a null is
        for k in ("tokens", "tags"):
            if not r[k]:
                del r[k]
        rows.append({k: base64.b64encode(v).decode() for k, v in r.items()})
    return rows


if __name__ == "__main__":
    root = sys.argv[1]
    t = table()
    for name, kw in {
        "snappy-v1": dict(compression="snappy"),
        "zstd-v2": dict(compression="zstd", data_page_version="2.0"),
        "gzip-plain": dict(compression="gzip", use_dictionary=False),
        "brotli-v2": dict(compression="brotli", data_page_version="2.0", use_dictionary=False),
        "lz4-crc": dict(compression="lz4", write_page_checksum=True),
        "none": dict(compression="none"),
    }.items():
        pq.write_table(t, os.path.join(root, name + ".parquet"), row_group_size=7, **kw)
    with open(os.path.join(root, "expected.json"), "w") as f:
        json.dump(expected(), f, indent=0)
