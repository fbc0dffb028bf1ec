"""Writes the MDS datasets under this folder with Mosaic streaming's own MDSWriter.

Made with mosaicml-streaming 0.13.0 (numpy 2.1.3, Python 3.11): streaming
pins numpy<2.2, so it runs in a virtualenv of its own, not the repository's:

    python3 -m venv /tmp/mds && /tmp/mds/bin/pip install mosaicml-streaming==0.13.0
    /tmp/mds/bin/python prefetch/testdata/mds/make.py prefetch/testdata/mds

Each dataset (one per compression) gets expected.json: every sample, in
order, as {column: base64 of the bytes MDS encodes it to}, which the Go
tests compare what ckptd delivers with.
"""

import base64
import json
import os
import shutil
import sys

from streaming import MDSWriter
from streaming.base.format.mds.encodings import mds_encode

COLUMNS = {"id": "int", "text": "str", "blob": "bytes", "label": "uint8", "vec": "ndarray:float32:3"}


def samples(n):
    import numpy as np

    for i in range(n):
        yield {
            "id": i * 7 - 3,
            "text": f"sample {i} " + "é" * (i % 5),
            "blob": bytes((i * 31 + j) % 256 for j in range(i * 13 % 200)),
            "label": np.uint8(i % 10),
            "vec": np.array([i, -i, i / 2], dtype=np.float32),
        }


def write(out, compression, hashes, n):
    shutil.rmtree(out, ignore_errors=True)
    with MDSWriter(out=out, columns=COLUMNS, compression=compression, hashes=hashes, size_limit=1500) as w:
        for s in samples(n):
            w.write(s)
    expected = [
        {k: base64.b64encode(mds_encode(COLUMNS[k], v)).decode() for k, v in s.items()} for s in samples(n)
    ]
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump(expected, f, indent=0)


if __name__ == "__main__":
    root = sys.argv[1]
    write(os.path.join(root, "plain"), None, ["sha1", "xxh3_64"], 40)
    write(os.path.join(root, "zstd"), "zstd:7", ["md5", "xxh64"], 30)
    write(os.path.join(root, "gz"), "gz", ["sha256"], 12)
    write(os.path.join(root, "bz2"), "bz2", ["blake2b"], 12)
    write(os.path.join(root, "br"), "br:5", ["xxh128"], 12)
    write(os.path.join(root, "snappy"), "snappy", ["sha3_256", "xxh32"], 12)
